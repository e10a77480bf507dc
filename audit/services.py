"""Appending to the audit chain.

Every service writes its audit event through `audit_append`, inside the same
transaction as the change it records. Appends are serialised on the AuditHead
row: `UPDATE audit_audithead SET seq = seq + 1 … RETURNING` takes its row lock
until the caller commits, so concurrent writers never fork the chain and seq
stays contiguous in commit order (a rolled-back append rolls back the head too).

Two statements per append, no savepoint: the head bump, then the INSERT of the
event and the head's new hash in one round trip (a data-modifying CTE).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from audit.chain import GENESIS_HASH, canonical_json, event_hash, hashed_fields
from audit.models import ActorType, AuditEvent, AuditHead
from console.requestctx import current_request_id

# Keys whose values must never reach the audit trail.
_SECRET_KEY_PATTERN = re.compile(r"(token|secret|password|authorization|api[_-]?key)", re.I)
_TOKEN_VALUE_PATTERN = re.compile(r"\b(ak|rt|pt)_[A-Za-z0-9_-]{8,}")

# One round trip per append. The head row is locked (FOR UPDATE re-reads the
# latest committed head after waiting, so the chain cannot fork), the event's
# hash is computed by PostgreSQL over the canonical JSON that Python prepared
# with everything but `seq` and `prev_hash` (which come last in sorted-key order,
# so the text is `<prefix><seq>},"prev_hash":"<prev>"}` — the very bytes
# `audit.chain.event_hash` hashes), then the event is inserted and the head moved.
_APPEND = """
WITH head AS (
    SELECT seq + 1 AS seq, hash AS prev FROM audit_audithead WHERE id = 1 FOR UPDATE
), h AS (
    SELECT seq, prev, encode(sha256(convert_to(
        %s || seq::text || '},"prev_hash":"' || prev || '"}', 'UTF8')), 'hex') AS digest
    FROM head
), event AS (
    INSERT INTO audit_auditevent (seq, created_at, actor_type, actor_id, actor_label,
        request_id, event_type, resource, run_id, action_id, details, prev_hash, hash)
    SELECT seq, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, prev, digest FROM h
)
UPDATE audit_audithead SET seq = h.seq, hash = h.digest FROM h
WHERE audit_audithead.id = 1
RETURNING h.seq, h.prev, h.digest
"""
_HASH_SUFFIX = '0},"prev_hash":""}'


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


def _storable(value: Any) -> Any:
    """Make a JSON value read back from PostgreSQL jsonb exactly as hashed.

    jsonb has no NaN/Infinity and no NUL characters, rejects lone surrogates, and
    prints an integral number given in exponent form (1e+16) as an integer — each
    of those would make the stored row hash differently from the appended one.
    """
    if isinstance(value, dict):
        return {_storable(key): _storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_storable(item) for item in value]
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value.is_integer() and "e" in repr(value):
            return int(Decimal(repr(value)))
    return value


def clean_details(details: dict[str, Any] | None) -> dict[str, Any]:
    # Round-trip through JSON so the hash covers exactly what is stored.
    cleaned: dict[str, Any] = _storable(json.loads(json.dumps(scrub(details or {}), default=str)))
    return cleaned


def _as_uuid(value: uuid.UUID | str | None) -> uuid.UUID | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


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
    details_clean = clean_details(details)
    run_uuid = _as_uuid(run_id)
    action_uuid = _as_uuid(action_id)
    rid = (request_id if request_id is not None else current_request_id())[:128]
    # Column limits applied before hashing, so the hash covers what is stored.
    actor = Actor(actor.type, _storable(actor.id)[:64], _storable(actor.label)[:200])
    event_type = _storable(event_type)[:64]
    resource = _storable(resource)[:320]
    rid = _storable(rid)
    created_at = timezone.now()
    fields = hashed_fields(
        seq=0,
        created_at=created_at,
        actor_type=actor.type,
        actor_id=actor.id,
        actor_label=actor.label,
        request_id=rid,
        event_type=event_type,
        resource=resource,
        run_id=run_uuid,
        action_id=action_uuid,
        details=details_clean,
    )
    template = canonical_json({"event": fields, "prev_hash": ""})
    if not template.endswith(_HASH_SUFFIX):  # the field set changed: fix _APPEND
        raise RuntimeError("audit hash layout is not <prefix><seq>},prev_hash")
    params: list[Any] = [
        template[: -len(_HASH_SUFFIX)],
        created_at,
        actor.type,
        actor.id,
        actor.label,
        rid,
        event_type,
        resource,
        run_uuid,
        action_uuid,
        json.dumps(details_clean, ensure_ascii=False),
    ]
    if connection.vendor == "postgresql":
        # One statement is atomic by itself: no BEGIN/COMMIT round trips of our
        # own when the caller is in autocommit (inside its transaction it is
        # simply the transaction's last statement).
        row = _execute_append(params)
        if row is None:  # the head row is missing (a flushed test database)
            AuditHead.objects.get_or_create(pk=1, defaults={"seq": 0, "hash": GENESIS_HASH})
            row = _execute_append(params)
        assert row is not None
        seq, prev_hash, digest = int(row[0]), str(row[1]), str(row[2])
    else:
        with transaction.atomic(savepoint=False):
            seq, prev_hash, digest = _append_portable(fields, params)
    event = AuditEvent(
        seq=seq,
        created_at=created_at,
        actor_type=actor.type,
        actor_id=actor.id,
        actor_label=actor.label,
        request_id=rid,
        event_type=event_type,
        resource=resource,
        run_id=run_uuid,
        action_id=action_uuid,
        details=details_clean,
        prev_hash=prev_hash,
        hash=digest,
    )
    event._state.adding = False
    event._state.db = "default"
    return event


def _append_portable(fields: dict[str, Any], params: list[Any]) -> tuple[int, str, str]:
    """The same append without PostgreSQL's sha256 (the embedded SQLite default)."""
    head = AuditHead.objects.select_for_update().get_or_create(
        pk=1, defaults={"seq": 0, "hash": GENESIS_HASH}
    )[0]
    seq = head.seq + 1
    digest = event_hash({**fields, "seq": seq}, head.hash)
    AuditEvent.objects.create(
        seq=seq,
        created_at=params[1],
        actor_type=params[2],
        actor_id=params[3],
        actor_label=params[4],
        request_id=params[5],
        event_type=params[6],
        resource=params[7],
        run_id=params[8],
        action_id=params[9],
        details=json.loads(params[10]),
        prev_hash=head.hash,
        hash=digest,
    )
    AuditHead.objects.filter(pk=1).update(seq=seq, hash=digest)
    return seq, head.hash, digest


def _execute_append(params: list[Any]) -> Any:
    # A server-side prepared statement (psycopg prepare=True) measured no faster
    # than Django's client-side binding here, so the Django cursor (with its
    # instrumentation) is kept.
    with connection.cursor() as cursor:
        cursor.execute(_APPEND, params)
        return cursor.fetchone()
