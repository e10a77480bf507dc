"""API: the audit trail (list, verify). Operators, admins and auditors."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import Query, Router, Schema

from approvals.api import errors
from audit.models import AuditEvent
from audit.selectors import audit_list, verify_chain
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


@router.get(
    "/audit/verify",
    auth=person_token,
    response={200: VerifyOut, **errors(401, 403)},
    summary="Walk the hash chain: {ok, events, first_bad_seq}",
    tags=["audit"],
)
def audit_verify(request: HttpRequest) -> HttpResponse:
    _require_reader(request)
    result = verify_chain()
    return json_response(
        {
            "ok": result.ok,
            "events": result.events,
            "first_bad_seq": result.first_bad_seq,
            "head_hash": result.head_hash,
            "problem": result.problem,
        }
    )
