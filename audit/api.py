"""API: the audit trail (list, verify). Operators, admins and auditors."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import time
import uuid
from datetime import datetime
from typing import Any

from django.core.cache import cache
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Field, Query, Router, Schema

from approvals.api import errors
from audit.chain import event_hash, hashed_fields
from audit.models import AuditEvent
from audit.selectors import audit_head, audit_list, verify_chain
from console.api_support import iso, json_response
from console.auth import person_token, principal_of
from console.core.errors import Forbidden
from console.permissions import can_read_everything

router = Router()


class AuditEventOut(Schema):
    seq: int
    created_at: datetime
    actor_type: str
    actor_id: str
    actor_label: str
    request_id: str
    event_type: str
    resource: str
    run: uuid.UUID | None
    action: uuid.UUID | None
    details: dict[str, Any]
    prev_hash: str
    hash: str


class AuditPageOut(Schema):
    items: list[AuditEventOut]
    next: str | None


class VerifyOut(Schema):
    ok: bool
    events: int
    first_bad_seq: int | None
    head_hash: str
    problem: str
    cached: bool = Field(
        False, description="The head has not moved since the last verification: its result"
    )
    checked_at: datetime | None = Field(None, description="When the chain was last walked")


def event_json(event: AuditEvent) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "created_at": iso(event.created_at),
        "actor_type": event.actor_type,
        "actor_id": event.actor_id,
        "actor_label": event.actor_label,
        "request_id": event.request_id,
        "event_type": event.event_type,
        "resource": event.resource,
        "run": str(event.run_id) if event.run_id else None,
        "action": str(event.action_id) if event.action_id else None,
        "details": event.details,
        "prev_hash": event.prev_hash,
        "hash": event.hash,
    }


def _require_reader(request: HttpRequest) -> None:
    if not can_read_everything(principal_of(request).user):
        raise Forbidden("The audit trail is for operators, admins and auditors.")


@router.get(
    "/audit",
    auth=person_token,
    response={200: AuditPageOut, **errors(400, 401, 403, 422)},
    summary="Audit events, newest first",
    tags=["audit"],
)
def audit_events(
    request: HttpRequest,
    resource: str | None = Query(None, pattern=r"^[A-Za-z0-9._:@+=,/*-]{0,320}$"),
    run: uuid.UUID | None = None,
    action: uuid.UUID | None = None,
    event_type: str | None = Query(None, pattern=r"^[a-z0-9_.*-]{0,64}$"),
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, max_length=40, pattern=r"^s\d{1,18}$"),
) -> HttpResponse:
    _require_reader(request)
    page = audit_list(
        filters={
            "resource": resource,
            "run": str(run) if run else None,
            "action": str(action) if action else None,
            "event_type": event_type,
        },
        cursor=cursor,
        limit=limit,
    )
    return json_response({"items": [event_json(e) for e in page.items], "next": page.next})


# --- Verification: cached per head, the new tail walked incrementally -------------
#
# The console's badge cache (audit/views.py) is shared: same key, same value shape.
# While the head (seq, hash) has not moved the cached result is the answer. When
# it moved and the cached result was ok, only the events after the cached head
# are walked (linked from the cached head hash) and compared with the new head.
# A full walk happens at least every VERIFY_CACHE_SECONDS (so an edit of an old
# row, which the append-only trigger refuses anyway, is still found), and on a
# cold cache. One request therefore never walks 10^6 rows more than once per window.

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


def _verify_cache() -> tuple[str, int]:
    from audit.views import _VERIFY_CACHE_KEY, VERIFY_CACHE_SECONDS

    return _VERIFY_CACHE_KEY, VERIFY_CACHE_SECONDS


def _verify_tail(*, after_seq: int, after_hash: str, head: tuple[int, str]) -> dict[str, Any]:
    """Walk the events after (after_seq, after_hash) and compare the end with the head."""
    expected_seq, expected_prev = after_seq + 1, after_hash
    rows = (
        # Bounded by the head read before the walk: later appends are the next call's tail.
        AuditEvent.objects.filter(seq__gt=after_seq, seq__lte=head[0])
        .order_by("seq")
        .values_list(*_CHAIN_FIELDS, named=True)
        .iterator(chunk_size=2000)
    )
    problem = ""
    first_bad: int | None = None
    for row in rows:
        if row.seq != expected_seq:
            first_bad, problem = expected_seq, "seq gap"
            break
        if row.prev_hash != expected_prev:
            first_bad, problem = row.seq, "broken link"
            break
        fields = hashed_fields(
            seq=row.seq,
            created_at=row.created_at,
            actor_type=row.actor_type,
            actor_id=row.actor_id,
            actor_label=row.actor_label,
            request_id=row.request_id,
            event_type=row.event_type,
            resource=row.resource,
            run_id=row.run_id,
            action_id=row.action_id,
            details=row.details,
        )
        if event_hash(fields, row.prev_hash) != row.hash:
            first_bad, problem = row.seq, "hash mismatch"
            break
        expected_prev = row.hash
        expected_seq += 1
    events = expected_seq - 1
    if first_bad is None and (head[0] != events or head[1] != expected_prev):
        first_bad = min(head[0], events) + 1
        problem = (
            f"head row says #{head[0]} {head[1][:12]}…, the chain ends at "
            f"#{events} {expected_prev[:12]}…"
        )
    return {
        "ok": first_bad is None,
        "events": events,
        "first_bad_seq": first_bad,
        "head_hash": expected_prev,
        "problem": problem,
    }


def audit_verify_cached() -> dict[str, Any]:
    """verify_chain's answer, cached per head; a moved head costs only its new tail."""
    key, window = _verify_cache()
    head = audit_head()
    cached = cache.get(key)
    if cached is not None and cached.get("head") == list(head):
        return dict(cached, cached=True)
    now = time.time()
    full_at = cached.get("full_walk_at") if cached is not None else None
    incremental = (
        cached is not None
        and cached.get("ok")
        and isinstance(full_at, float)
        and now - full_at < window
        and isinstance(cached.get("head"), list)
        and head[0] > cached["head"][0]
    )
    if incremental:
        assert cached is not None
        previous_seq, previous_hash = cached["head"]
        result = _verify_tail(after_seq=previous_seq, after_hash=previous_hash, head=head)
    else:
        full = verify_chain()  # compares its own end with the head row it reads last
        full_at = now
        if full.ok:
            head = (full.events, full.head_hash)
        result = {
            "ok": full.ok,
            "events": full.events,
            "first_bad_seq": full.first_bad_seq,
            "head_hash": full.head_hash,
            "problem": full.problem,
        }
    value = {
        **result,
        "head": list(head),
        "checked_at": timezone.now(),
        "full_walk_at": full_at,
        "walk": "tail" if incremental else "full",
    }
    cache.set(key, value, window)
    return dict(value, cached=False)


@router.get(
    "/audit/verify",
    auth=person_token,
    response={200: VerifyOut, **errors(401, 403)},
    summary="Verify the hash chain: {ok, events, first_bad_seq}",
    description="The result is cached per audit head (seq, hash): while the head has not "
    "moved the last result is returned (`cached: true`); when it moved only the new events "
    "are walked, linked from the last verified head. The whole chain is walked at least "
    "every 5 minutes.",
    tags=["audit"],
)
def audit_verify(request: HttpRequest) -> HttpResponse:
    _require_reader(request)
    result = audit_verify_cached()
    return json_response(
        {
            "ok": result["ok"],
            "events": result["events"],
            "first_bad_seq": result["first_bad_seq"],
            "head_hash": result["head_hash"],
            "problem": result["problem"],
            "cached": result["cached"],
            "checked_at": iso(result["checked_at"]),
        }
    )
