"""Reading the audit trail: filtered, cursor-paginated lists and the chain walk."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet

from audit.chain import VerifyResult, verify_rows
from audit.models import AuditEvent, AuditHead
from console.core.errors import ValidationFailed

MAX_LIMIT = 200
FILTER_NAMES = ("resource", "run", "action", "event_type", "actor_type", "actor_id")


@dataclass(frozen=True)
class AuditPage:
    items: list[AuditEvent]
    next: str | None


def _uuid(name: str, value: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError as exc:
        raise ValidationFailed(
            f"{name} must be a UUID", extra={"errors": [{"field": name, "message": "not a UUID"}]}
        ) from exc


def audit_queryset(filters: Mapping[str, Any] | None = None) -> QuerySet[AuditEvent]:
    """Events matching `filters` (unknown keys ignored, empty values ignored).

    resource: exact `kind/name`, or a prefix ending in `*`; run, action: UUIDs;
    event_type: exact, or a prefix ending in `*` (e.g. `write.*`); actor_type, actor_id.
    """
    qs = AuditEvent.objects.all()
    for name, value in (filters or {}).items():
        if value in (None, "") or name not in FILTER_NAMES:
            continue
        value = str(value)
        if name == "resource":
            qs = (
                qs.filter(resource__startswith=value[:-1])
                if value.endswith("*")
                else qs.filter(resource=value)
            )
        elif name == "run":
            qs = qs.filter(run_id=_uuid(name, value))
        elif name == "action":
            qs = qs.filter(action_id=_uuid(name, value))
        elif name == "event_type":
            qs = (
                qs.filter(event_type__startswith=value[:-1])
                if value.endswith("*")
                else qs.filter(event_type=value)
            )
        elif name == "actor_type":
            qs = qs.filter(actor_type=value)
        elif name == "actor_id":
            qs = qs.filter(actor_id=value)
    return qs


def audit_list(
    *,
    filters: Mapping[str, Any] | None = None,
    cursor: str | None = None,
    limit: int = 50,
    newest_first: bool = True,
) -> AuditPage:
    """One page of events. The cursor is the opaque `next` of the previous page
    (keyset pagination on seq: stable while new events are appended).

    Who may read the trail is the caller's check (console.permissions.can_read_everything).
    Raises ValidationFailed for a bad cursor, limit or filter value.
    """
    if not 1 <= limit <= MAX_LIMIT:
        raise ValidationFailed(
            f"limit must be between 1 and {MAX_LIMIT}",
            extra={"errors": [{"field": "limit", "message": "out of range"}]},
        )
    qs = audit_queryset(filters)
    if cursor:
        try:
            after = int(cursor.removeprefix("s"))
        except ValueError as exc:
            raise ValidationFailed(
                "invalid cursor", extra={"errors": [{"field": "cursor", "message": "invalid"}]}
            ) from exc
        qs = qs.filter(seq__lt=after) if newest_first else qs.filter(seq__gt=after)
    qs = qs.order_by("-seq" if newest_first else "seq")
    items = list(qs[: limit + 1])
    more = len(items) > limit
    items = items[:limit]
    return AuditPage(items=items, next=f"s{items[-1].seq}" if more and items else None)


def audit_head() -> tuple[int, str]:
    head = AuditHead.objects.filter(pk=1).values_list("seq", "hash").first()
    return (int(head[0]), str(head[1])) if head else (0, "0" * 64)


_CHAIN_FIELDS = (
    "seq",
    "created_at",
    "actor_type",
    "actor_id",
    "actor_label",
    "request_id",
    "event_type",
    "resource",
    "run_id",
    "action_id",
    "details",
    "prev_hash",
    "hash",
)


def _stream(chunk_size: int) -> Iterator[Any]:
    # Named tuples, not model instances: the walk is about twice as fast.
    return (
        AuditEvent.objects.order_by("seq")
        .values_list(*_CHAIN_FIELDS, named=True)
        .iterator(chunk_size=chunk_size)
    )


def verify_chain(*, chunk_size: int = 2000) -> VerifyResult:
    """Walk the whole chain in seq order (streamed) and compare its end with the head row.

    Detects an edited row (hash mismatch), a deleted or inserted row (seq gap or
    broken link), reordered rows (broken link) and a truncated tail (the head
    row says the chain is longer). The head hash printed by `audit_verify` is
    what to anchor outside the database: a forger who rewrites the tail *and*
    the head row is caught only by comparing with an anchored hash.
    """
    result = verify_rows(_stream(chunk_size))
    if not result.ok:
        return result
    head_seq, head_hash = audit_head()
    if head_seq != result.events or head_hash != result.head_hash:
        first_bad = min(head_seq, result.events) + 1
        return VerifyResult(
            False,
            result.events,
            first_bad,
            result.head_hash,
            f"head row says #{head_seq} {head_hash[:12]}…, the chain ends at "
            f"#{result.events} {result.head_hash[:12]}…",
        )
    return result
