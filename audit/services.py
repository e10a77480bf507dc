"""Appending to the audit chain.

Every service writes its audit event through `audit_append`, inside the same
transaction as the change it records. Appends are serialised on the AuditHead
row (SELECT … FOR UPDATE), so concurrent writers never fork the chain and seq
stays contiguous in commit order.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from audit.chain import event_hash, hashed_fields
from audit.models import ActorType, AuditEvent, AuditHead
from console.requestctx import current_request_id

# Keys whose values must never reach the audit trail.
_SECRET_KEY_PATTERN = re.compile(r"(token|secret|password|authorization|api[_-]?key)", re.I)
_TOKEN_VALUE_PATTERN = re.compile(r"\b(ak|rt|pt)_[A-Za-z0-9_-]{8,}")


@dataclass(frozen=True)
class Actor:
    """Who did it: a person, an agent, a run or the system."""

    type: str
    id: str = ""
    label: str = ""

    @classmethod
    def system(cls, label: str = "airlock") -> Actor:
        return cls(ActorType.SYSTEM, "", label)

    @classmethod
    def person(cls, user: Any) -> Actor:
        return cls(ActorType.PERSON, str(user.pk), user.get_username())

    @classmethod
    def agent(cls, agent: Any) -> Actor:
        return cls(ActorType.AGENT, str(agent.pk), agent.name)

    @classmethod
    def run(cls, run: Any) -> Actor:
        return cls(ActorType.RUN, str(run.pk), f"{run.agent.name}/{str(run.pk)[:8]}")


def scrub(value: Any) -> Any:
    """Drop secret-looking keys and token-looking strings from audit details."""
    if isinstance(value, dict):
        return {
            key: ("[redacted]" if _SECRET_KEY_PATTERN.search(str(key)) else scrub(item))
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [scrub(item) for item in value]
    if isinstance(value, str):
        return _TOKEN_VALUE_PATTERN.sub("[redacted]", value)
    return value


def audit_append(
    *,
    event_type: str,
    actor: Actor,
    resource: str = "",
    run_id: uuid.UUID | str | None = None,
    action_id: uuid.UUID | str | None = None,
    details: dict[str, Any] | None = None,
    request_id: str | None = None,
) -> AuditEvent:
    """Append one event to the chain, inside the caller's transaction.

    Locks the AuditHead row until the caller commits: keep it the last step
    of a transaction so the lock is held briefly.
    """
    # Round-trip through JSON so the hash covers exactly what is stored.
    clean_details: dict[str, Any] = json.loads(json.dumps(scrub(details or {}), default=str))
    with transaction.atomic():
        head = AuditHead.objects.select_for_update().get(pk=1)
        seq = head.seq + 1
        created_at = timezone.now()
        fields = hashed_fields(
            seq=seq,
            created_at=created_at,
            actor_type=actor.type,
            actor_id=actor.id,
            actor_label=actor.label,
            request_id=request_id if request_id is not None else current_request_id(),
            event_type=event_type,
            resource=resource,
            run_id=run_id,
            action_id=action_id,
            details=clean_details,
        )
        digest = event_hash(fields, head.hash)
        event = AuditEvent.objects.create(
            seq=seq,
            created_at=created_at,
            actor_type=actor.type,
            actor_id=actor.id,
            actor_label=actor.label,
            request_id=fields["request_id"],
            event_type=event_type,
            resource=resource,
            run_id=run_id,
            action_id=action_id,
            details=clean_details,
            prev_hash=head.hash,
            hash=digest,
        )
        AuditHead.objects.filter(pk=1).update(seq=seq, hash=digest)
    return event
