"""API: the audit trail (list, verify). Operators, admins and auditors."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import Field, Query, Router, Schema

from audit.linker import audit_link
from audit.selectors import audit_list
from audit.serialize import event_json
from audit.services import audit_chain_status
from console.api_support import iso, json_response
from console.auth import person_token, principal_of
from console.permissions import can_read_everything
from console.problems import errors
from engine.core.errors import Forbidden

router = Router(auth=person_token, tags=["audit"])


class AuditEventOut(Schema):
    """Every value is the hashed one (docs/audit-chain.md): `run` and `action` are hashed as
    `run_id` and `action_id`; keys added later are not hashed."""

    seq: int
    created_at: datetime = Field(
        description="UTC, always with six microsecond digits "
        "(`2026-12-06T03:00:00.000000+00:00`): the very text hashed"
    )
    actor_type: str
    actor_id: str
    actor_label: str
    request_id: str
    event_type: str
    resource: str
    run: uuid.UUID | None
    action: uuid.UUID | None
    details: dict[str, Any]
    prev_hash: str = Field(description="The previous event's hash; 64 zeros for seq 1")
    hash: str = Field(
        description='SHA-256 (hex) of the canonical JSON of {"event": <the hashed fields>, '
        '"prev_hash": …} (docs/audit-chain.md)'
    )


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
    checked_at: datetime | None = Field(None, description="When the chain was last verified")
    full_walk_at: datetime | None = Field(
        None,
        description="When the whole chain was last walked (`manage.py audit_verify` or the "
        "periodic job); later checks walk only the events appended since",
    )
    linked_seq: int = Field(
        0,
        description="The head: events commit unlinked and the `audit` process links them in "
        "seq order; every committed event up to this seq is linked",
    )
    behind_seconds: float = Field(
        0.0,
        description="How long the oldest committed event past the head has waited to be "
        "linked (`ok` is false once it passes AIRLOCK_AUDIT_LINK_BOUND_SECONDS)",
    )


def _require_reader(request: HttpRequest) -> None:
    if not can_read_everything(principal_of(request).user):
        raise Forbidden("The audit trail is for operators, admins and auditors.")


@router.get(
    "/audit",
    response={200: AuditPageOut, **errors(400, 401, 403, 422)},
    summary="Audit events, newest first",
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
    audit_link()  # what has committed is served linked, but for a moment's newest events
    page = audit_list(
        filters={"resource": resource, "run": run, "action": action, "event_type": event_type},
        cursor=cursor,
        limit=limit,
    )
    return json_response({"items": [event_json(e) for e in page.items], "next": page.next})


@router.get(
    "/audit/verify",
    response={200: VerifyOut, **errors(401, 403)},
    summary="Verify the hash chain: {ok, events, first_bad_seq}",
    description="Checked from a checkpoint every process shares (the last verified seq and "
    "hash): while the head has not moved the last result is returned (`cached: true`); when "
    "it moved only the new events are walked, linked from the checkpoint. The whole chain is "
    "walked by `manage.py audit_verify` and by a periodic job (`full_walk_at`); a break they "
    "find is returned here until a whole walk finds the chain whole again.",
)
def audit_verify(request: HttpRequest) -> HttpResponse:
    _require_reader(request)
    status = audit_chain_status()
    return json_response(
        {
            "ok": status.ok,
            "events": status.events,
            "first_bad_seq": status.first_bad_seq,
            "head_hash": status.head_hash,
            "problem": status.problem,
            "cached": status.cached,
            "checked_at": iso(status.checked_at),
            "full_walk_at": iso(status.full_walk_at),
            "linked_seq": status.linked_seq,
            "behind_seconds": status.behind_seconds,
        }
    )
