"""Reading the audit trail: filtered, keyset-paginated lists and the chain walk."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Max, Q, QuerySet

from approvals.models import Agent, Run
from audit.chain import GENESIS_HASH, HASHED_COLUMNS, VerifyResult, against_head, verify_rows
from audit.models import AuditEvent, AuditHead
from console.core.errors import ValidationFailed

_MAX_LIMIT = 200

# Only what the walk needs: named tuples, not model instances (about twice as fast).
_CHAIN_FIELDS = (*HASHED_COLUMNS, "prev_hash", "hash")


@dataclass(frozen=True)
class AuditPage:
    items: list[AuditEvent]
    next: str | None


def _invalid(name: str, message: str, detail: str) -> ValidationFailed:
    return ValidationFailed(detail, extra={"errors": [{"field": name, "message": message}]})


def _uuid(name: str, value: Any) -> uuid.UUID:
    try:
        return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
    except ValueError as exc:
        raise _invalid(name, "not a UUID", f"{name} must be a UUID") from exc


def _exact_or_prefix(field: str, value: Any) -> Q:
    text = str(value)
    return Q(**{f"{field}__startswith": text[:-1]}) if text.endswith("*") else Q(**{field: text})


def _by_agent(name: Any) -> Q | None:
    """The agent's own events and its runs' events; None when no such agent."""
    agent = Agent.objects.filter(name=str(name)).first()
    if agent is None:
        return None
    runs = Run.objects.filter(agent=agent).values("id")
    return Q(actor_type="agent", actor_id=str(agent.pk)) | Q(run_id__in=runs)


def _by_person(username: Any) -> Q | None:
    person = User.objects.filter(username=str(username)).first()
    if person is None:
        return None
    return Q(actor_type="person", actor_id=str(person.pk))


def _moment(name: str, value: Any) -> datetime:
    if not isinstance(value, datetime):
        raise _invalid(name, "not a date and time", f"{name} must be a date and time")
    return value


# Each filter name → the condition it adds (None: matches nothing).
_FILTERS: dict[str, Callable[[Any], Q | None]] = {
    "resource": lambda value: _exact_or_prefix("resource", value),
    "event_type": lambda value: _exact_or_prefix("event_type", value),
    "run": lambda value: Q(run_id=_uuid("run", value)),
    "action": lambda value: Q(action_id=_uuid("action", value)),
    "actor_type": lambda value: Q(actor_type=str(value)),
    "actor_id": lambda value: Q(actor_id=str(value)),
    "agent": _by_agent,
    "person": _by_person,
    "since": lambda value: Q(created_at__gte=_moment("since", value)),
    "until": lambda value: Q(created_at__lt=_moment("until", value)),
}


def audit_queryset(filters: Mapping[str, Any] | None = None) -> QuerySet[AuditEvent]:
    """Events matching `filters` (unknown keys and empty values ignored).

    resource, event_type: exact, or a prefix ending in `*` (e.g. `write.*`);
    run, action: UUIDs; actor_type, actor_id; agent: an agent's name (its own
    events and its runs'); person: a username; since, until: datetimes.
    """
    events = AuditEvent.objects.all()
    for name, value in (filters or {}).items():
        if value in (None, "") or name not in _FILTERS:
            continue
        condition = _FILTERS[name](value)
        if condition is None:
            return events.none()
        events = events.filter(condition)
    return events


def audit_list(
    *,
    filters: Mapping[str, Any] | None = None,
    cursor: str | None = None,
    limit: int = 50,
    newest_first: bool = True,
) -> AuditPage:
    """One page of events (newest first unless asked). The cursor is the opaque `next` of the
    previous page (keyset pagination on seq: stable while new events are appended).

    Who may read the trail is the caller's check (console.permissions.can_read_everything).
    Raises ValidationFailed for a bad cursor, limit or filter value.
    """
    if not 1 <= limit <= _MAX_LIMIT:
        raise _invalid("limit", "out of range", f"limit must be between 1 and {_MAX_LIMIT}")
    events = audit_queryset(filters)
    if cursor:
        try:
            after = int(cursor.removeprefix("s"))
        except ValueError as exc:
            raise _invalid("cursor", "invalid", "invalid cursor") from exc
        events = events.filter(seq__lt=after) if newest_first else events.filter(seq__gt=after)
    items = list(events.order_by("-seq" if newest_first else "seq")[: limit + 1])
    more = len(items) > limit
    items = items[:limit]
    return AuditPage(items=items, next=f"s{items[-1].seq}" if more and items else None)


def audit_head() -> tuple[int, str]:
    head = AuditHead.objects.filter(pk=1).values_list("seq", "hash").first()
    return (int(head[0]), str(head[1])) if head else (0, GENESIS_HASH)


def verify_chain(*, after: tuple[int, str] | None = None, chunk_size: int = 2000) -> VerifyResult:
    """Walk the chain in seq order (streamed) and compare its end with the head row.

    The whole chain by default; with `after=(seq, hash)`, a point already verified,
    only the events after it (the walk then starts from that hash). The walk stops
    at the head read before it, so appends made meanwhile are the next walk's tail.

    Detects an edited row (hash mismatch), a deleted or inserted row (seq gap or
    broken link), reordered rows (broken link) and a truncated tail (the head
    row says the chain is longer); a whole walk also finds a row inserted behind
    the head row's back. The head hash printed by `audit_verify` is what to anchor
    outside the database: a forger who rewrites the tail *and* the head row is
    caught only by comparing with an anchored hash.
    """
    head_seq, head_hash = audit_head()
    after_seq, after_hash = after or (0, GENESIS_HASH)
    rows = AuditEvent.objects.filter(seq__lte=head_seq).order_by("seq")
    if after is not None:
        rows = rows.filter(seq__gt=after_seq)
    # Inside a transaction the server-side cursor streams instead of being
    # materialised WITH HOLD first, as it is in autocommit.
    with transaction.atomic():
        walked = verify_rows(
            rows.values_list(*_CHAIN_FIELDS, named=True).iterator(chunk_size=chunk_size),
            after_seq=after_seq,
            after_hash=after_hash,
        )
    result = against_head(walked, head_seq=head_seq, head_hash=head_hash)
    if after is None and result.ok:
        result = _nothing_beyond_the_head(result)
    return result


def _nothing_beyond_the_head(result: VerifyResult) -> VerifyResult:
    # The highest seq first, then the head: an append commits its row and the head
    # together, so a row above a head read afterwards was not appended by audit_append.
    highest = AuditEvent.objects.aggregate(highest=Max("seq"))["highest"] or 0
    head_seq, _ = audit_head()
    if highest <= head_seq:
        return result
    return replace(
        result,
        ok=False,
        first_bad_seq=head_seq + 1,
        problem=f"event #{highest} stands beyond the head row (#{head_seq})",
    )
