"""API: runs, actions (with long-poll), approvals and undo.

Handlers are thin: parse, authorise, call one service, render.
"""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Field, Path, Query, Router, Schema
from pydantic import ConfigDict

from approvals.models import (
    FINAL_ACTION_STATUSES,
    Action,
    Approval,
    ApprovalStatus,
    ApprovalSubject,
    Decision,
    Operation,
    Run,
    RunStatus,
)
from approvals.notify import action_waiters
from approvals.services import actions as action_services
from approvals.services import idempotency
from approvals.services import runs as run_services
from approvals.services.tokens import Principal
from console.api_support import (
    TEXT_PATTERN,
    TIME_CURSOR_PATTERN,
    JsonInt,
    RoleBearer,
    iso,
    json_bytes,
    json_response,
    rate_limit_writes,
    read_body,
    replay_response,
    time_page,
)
from console.auth import (
    agent_or_run_token,
    agent_token,
    any_token,
    any_token_or_ended_run,
    person_token,
    principal_of,
    run_has_ended,
    run_or_person_token,
)
from console.core.errors import NotFound
from console.permissions import can_decide_approvals, can_read_everything, is_admin
from console.problems import ApiError, Problem

router = Router()

MAX_WAIT_SECONDS = 60
# While subscribed, a waiter still re-reads this often in case a wake-up was lost.
SAFETY_RECHECK_SECONDS = 15.0
RESOURCE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}/([A-Za-z0-9][A-Za-z0-9._:@+=,-]{0,254}\*?|\*)$"
# RFC 9110: "*" or a comma-separated list of (possibly weak) entity tags.
ETAG_LIST_PATTERN = r'^[ \t]*(\*|(W/)?"[!#-~]*"([ \t]*,[ \t]*(W/)?"[!#-~]*")*)[ \t]*$'
PREFER_PATTERN = r"^[ \t]*[Ww][Aa][Ii][Tt][ \t]*=[ \t]*[0-9]{1,6}[ \t]*$"


def errors(*statuses: int) -> dict[int, type[Problem]]:
    return dict.fromkeys(statuses, Problem)


# --- Schemas -------------------------------------------------------------------


class WriteSetEntryIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    resource: str = Field(
        ...,
        description="`kind/name`, or `kind/prefix*` for every name starting with prefix",
        pattern=RESOURCE_PATTERN,
        examples=["notification-policy/prod-alerts"],
    )
    operations: list[Literal["create", "update", "delete"]] = Field(..., min_length=1)
    lease: bool = Field(
        False,
        description="Hold an exclusive, fenced lease on these resources while the run is "
        "active: other runs' writes to them answer 423 `leased`. Overlapping leases of two "
        "runs, or a lease over another run's write still in flight, are a 409 "
        "`write_set_conflict`.",
    )


class RunCreateIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    task: str = Field(..., min_length=1, max_length=2000, pattern=TEXT_PATTERN)
    write_set: list[WriteSetEntryIn] = Field(..., min_length=1, max_length=100)
    ttl_seconds: JsonInt | None = Field(
        None, ge=run_services.MIN_TTL_SECONDS, le=settings.AIRLOCK_RUN_MAX_TTL_SECONDS
    )


class WriteSetEntryOut(Schema):
    resource: str
    operations: list[str]
    lease: bool = Field(False, description="Present (true) when the entry asked for a lease")


class RunOut(Schema):
    id: uuid.UUID
    status: Literal["pending_approval", "active", "rejected", "finished", "expired", "revoked"]
    agent: str
    task: str
    write_set: list[WriteSetEntryOut]
    ttl_seconds: int
    expires_at: datetime
    max_expires_at: datetime
    auto_approved: bool
    status_reason: str
    created_at: datetime
    activated_at: datetime | None
    ended_at: datetime | None
    url: str


class RunCreatedOut(RunOut):
    token: str = Field(..., description="The run token (rt_…); shown once")


class RunPage(Schema):
    items: list[RunOut]
    next: str | None


class ApprovalInfo(Schema):
    mode: Literal["per_run", "per_call"]
    decision: Literal["pending", "approved", "rejected", "expired", "cancelled"]
    by: str | None
    at: datetime | None
    approval_id: uuid.UUID | None = None
    approvals_so_far: int = 0
    quorum: int = 1


class ExecutionInfo(Schema):
    fence: int
    status: str
    result_etag: str | None
    finished_at: datetime | None
    undo_deadline: datetime | None


class ConflictInfo(Schema):
    model_config = ConfigDict(extra="allow")

    conflict_id: uuid.UUID
    resource: str
    expected_etag: str | None
    current_etag: str | None
    conflict_class: str
    resolver: str
    retryable_by_agent: bool
    status: str


class UndoInfo(Schema):
    model_config = ConfigDict(extra="allow")

    status: str
    conflict_id: str | None = None


class ActionOut(Schema):
    id: uuid.UUID
    run: uuid.UUID
    agent: str
    resource: str
    operation: Literal["create", "update", "delete"]
    status: Literal[
        "pending_approval",
        "queued",
        "executing",
        "applied",
        "conflict",
        "rejected",
        "failed",
        "expired",
        "cancelled",
        "paused",
        "undone",
    ]
    etag: str
    observed_etag: str | None
    conflict_class: str
    reason: str
    paused_reason: str
    approval: ApprovalInfo | None
    execution: ExecutionInfo | None
    conflict: ConflictInfo | None
    resolution: str | None
    resolution_action: uuid.UUID | None
    parent: uuid.UUID | None
    undo: UndoInfo | None
    error: dict[str, Any] | None
    url: str
    created_at: datetime
    updated_at: datetime


class ActionPage(Schema):
    items: list[ActionOut]
    next: str | None


class DiffRow(Schema):
    path: str
    current: Any = None
    proposed: Any = None


class ApprovalItem(Schema):
    id: uuid.UUID
    subject: Literal["run", "action"]
    run: uuid.UUID
    action: uuid.UUID | None
    agent: str
    task: str
    write_set: list[WriteSetEntryOut] | None
    resource: str | None
    operation: str | None
    conflict_class: str | None
    diff: list[DiffRow] | None
    observed_etag: str | None
    current_etag: str | None
    approvals_so_far: int
    quorum: int
    expires_at: datetime
    status: Literal["pending", "approved", "rejected", "expired", "cancelled"]
    created_at: datetime


class ApprovalPage(Schema):
    items: list[ApprovalItem]
    next: str | None


class DecisionIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    decision: Literal["approve", "reject"]
    comment: str = Field("", max_length=2000, pattern=TEXT_PATTERN)


# --- Serialisation ---------------------------------------------------------------


def run_json(run: Run) -> dict[str, Any]:
    return {
        "id": str(run.pk),
        "status": run_services.run_effective_status(run),
        "agent": run.agent.name,
        "task": run.task,
        "write_set": run.write_set,
        "ttl_seconds": run.ttl_seconds,
        "expires_at": iso(run.expires_at),
        "max_expires_at": iso(run.max_expires_at),
        "auto_approved": run.auto_approved,
        "status_reason": run.status_reason,
        "created_at": iso(run.created_at),
        "activated_at": iso(run.activated_at),
        "ended_at": iso(run.ended_at),
        "url": f"/api/v1/runs/{run.pk}",
    }


def _approval_info(action: Action) -> dict[str, Any]:
    approval = Approval.objects.filter(action=action).order_by("-created_at").first()
    if approval is None:
        run = action.run
        approvers, quorum = _run_votes(run)
        return {
            "mode": "per_run",
            "decision": "approved" if run.activated_at else "pending",
            "by": "auto-approve" if run.auto_approved else (", ".join(approvers) or None),
            "at": iso(run.activated_at),
            "approval_id": None,
            # An auto-approved run counts its rule as its one approval.
            "approvals_so_far": 1 if run.auto_approved and run.activated_at else len(approvers),
            "quorum": quorum,
        }
    votes = list(approval.decisions.select_related("person").order_by("created_at"))
    approvers = [v.person.get_username() for v in votes if v.decision == Decision.APPROVE]
    rejecter = next((v.person.get_username() for v in votes if v.decision == Decision.REJECT), None)
    by: str | None = rejecter if approval.status == ApprovalStatus.REJECTED else None
    if by is None and approvers:
        by = ", ".join(approvers)
    if by is None and approval.from_conflict_id is not None:
        conflict = approval.from_conflict
        by = conflict.resolved_by.get_username() if conflict and conflict.resolved_by else None
    return {
        "mode": "per_call",
        "decision": approval.status,
        "by": by,
        "at": iso(approval.decided_at),
        "approval_id": str(approval.pk),
        "approvals_so_far": len(approvers),
        "quorum": approval.quorum,
    }


def _run_votes(run: Run) -> tuple[list[str], int]:
    """Who approved the run (so far) and the quorum its approval asks for."""
    approval = (
        Approval.objects.filter(run=run, subject=ApprovalSubject.RUN)
        .order_by("-created_at")
        .first()
    )
    if approval is None:
        return [], 1
    names = [
        d.person.get_username()
        for d in approval.decisions.select_related("person")
        .filter(decision=Decision.APPROVE)
        .order_by("created_at")
    ]
    return names, approval.quorum


def _execution_info(action: Action) -> dict[str, Any] | None:
    operation = (
        Operation.objects.filter(action=action, undo_of__isnull=True)
        .order_by("-started_at")
        .first()
    )
    if operation is None:
        return None
    return {
        "fence": operation.fence,
        "status": operation.status,
        "result_etag": (
            f'"{operation.result_version}"' if operation.result_version is not None else None
        ),
        "finished_at": iso(operation.finished_at),
        "undo_deadline": iso(operation.undo_deadline),
    }


def action_json(action: Action) -> dict[str, Any]:
    from ownership.models import Conflict

    conflict = (
        Conflict.objects.filter(action=action, origin="write")
        .select_related("conflict_class")
        .first()
    )
    conflict_info = None
    if conflict is not None:
        conflict_info = {
            "conflict_id": str(conflict.pk),
            "resource": action.resource_identifier,
            "expected_etag": f'"{conflict.base_version}"',
            "current_etag": f'"{conflict.current_version}"',
            "conflict_class": conflict.conflict_class_id,
            "resolver": conflict.resolver,
            "retryable_by_agent": conflict.conflict_class.retryable_by_agent,
            "status": conflict.status,
        }
    undo = None
    try:
        from approvals.services.undo import undo_status

        undo = undo_status(action)
    except (ImportError, NotImplementedError):
        undo = None
    return {
        "id": str(action.pk),
        "run": str(action.run_id),
        "agent": action.run.agent.name,
        "resource": action.resource_identifier,
        "operation": action.operation,
        "status": action.status,
        "etag": action.etag,
        "observed_etag": action.observed_etag,
        "conflict_class": action.conflict_class_id,
        "reason": action.reason,
        "paused_reason": action.paused_reason,
        "approval": _approval_info(action),
        "execution": _execution_info(action),
        "conflict": conflict_info,
        "resolution": (conflict.resolution or None) if conflict else None,
        "resolution_action": (
            str(conflict.resolution_action_id)
            if conflict and conflict.resolution_action_id
            else None
        ),
        "parent": str(action.parent_id) if action.parent_id else None,
        "undo": undo,
        "error": action.error if isinstance(action.error, dict) else None,
        "url": f"/api/v1/actions/{action.pk}",
        "created_at": iso(action.created_at),
        "updated_at": iso(action.updated_at),
    }


def action_body(action: Action) -> bytes:
    return json_bytes(action_json(action))


def _load_action(action_id: uuid.UUID) -> Action:
    return Action.objects.select_related("kind", "conflict_class", "run__agent").get(pk=action_id)


# --- Runs ----------------------------------------------------------------------

_PREFER_DOC_BASE: dict[str, Any] = {
    "in": "header",
    "name": "Prefer",
    "required": False,
    "schema": {"type": "string"},
}


def _run_for(principal: Principal, run_id: uuid.UUID) -> Run:
    run = Run.objects.select_related("agent").filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"Run {run_id} not found.")
    if principal.kind == "run":
        assert principal.run is not None
        if principal.run.pk != run.pk:
            raise NotFound(f"Run {run_id} not found.")
    elif principal.kind == "agent":
        assert principal.agent is not None
        if principal.agent.pk != run.agent_id:
            raise NotFound(f"Run {run_id} not found.")
    else:
        from approvals.selectors import run_list_for_actor

        if not run_list_for_actor(principal.user).filter(pk=run.pk).exists():
            raise NotFound(f"Run {run_id} not found.")
    return run


@router.post(
    "/runs",
    auth=agent_token,
    response={201: RunCreatedOut, **errors(400, 401, 403, 409, 413, 422, 429)},
    summary="Create a run with a declared write set",
    tags=["runs"],
)
def run_create(request: HttpRequest, payload: RunCreateIn) -> HttpResponse:
    principal = principal_of(request)
    rate_limit_writes(principal)
    assert principal.agent is not None
    run, token = run_services.run_create(
        agent=principal.agent,
        task=payload.task,
        write_set=[entry.model_dump() for entry in payload.write_set],
        ttl_seconds=payload.ttl_seconds,
        actor=principal.actor,
    )
    body = run_json(run) | {"token": token}
    return json_response(body, status=201, headers={"Location": body["url"]})


@router.get(
    "/runs",
    auth=any_token_or_ended_run,
    response={200: RunPage, **errors(400, 401, 422)},
    summary="List runs visible to the caller",
    tags=["runs"],
)
def run_list(
    request: HttpRequest,
    status: Literal["pending_approval", "active", "rejected", "finished", "expired", "revoked"]
    | None = None,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=TIME_CURSOR_PATTERN),
) -> HttpResponse:
    principal = principal_of(request)
    runs = Run.objects.select_related("agent")
    if principal.kind == "run":
        assert principal.run is not None
        runs = runs.filter(pk=principal.run.pk)
    elif principal.kind == "agent":
        runs = runs.filter(agent=principal.agent)
    else:
        from approvals.selectors import run_list_for_actor

        runs = run_list_for_actor(principal.user)
    if status:
        runs = runs.filter(status=status)
    page, next_cursor = time_page(runs, cursor=cursor, limit=limit)
    return json_response({"items": [run_json(run) for run in page], "next": next_cursor})


@dataclass(frozen=True)
class RunState:
    etag: str
    status: str
    body: bytes
    # An active run turns `expired` at this moment without any publish: a waiter
    # re-reads then instead of sleeping through it.
    expires_at: datetime | None


def _run_state(principal: Principal, run_id: uuid.UUID, close: bool) -> RunState:
    """Read the run. Its ETag is a digest of its representation, so it changes with
    its status (and with anything else the body shows, such as a heartbeat's expiry)."""
    try:
        run = _run_for(principal, run_id)
        body = json_bytes(run_json(run))
        status = run_services.run_effective_status(run)
        return RunState(
            etag=f'"r{hashlib.sha256(body).hexdigest()[:24]}"',
            status=status,
            body=body,
            expires_at=run.expires_at if status == RunStatus.ACTIVE else None,
        )
    finally:
        if close and not connection.in_atomic_block:
            # Hand the connection back (to the pool) before the request waits.
            connection.close()


def _run_should_hold(state: RunState, condition: action_services.TagCondition | None) -> bool:
    if condition is not None:
        return condition.weak_match(state.etag)
    # Without If-None-Match a run is held while it waits for a person's decision.
    return state.status == RunStatus.PENDING_APPROVAL


def _run_response(
    state: RunState, condition: action_services.TagCondition | None, wait: int | None
) -> HttpResponse:
    status = 304 if condition is not None and condition.weak_match(state.etag) else 200
    if status == 304:
        response = HttpResponse(status=304)
    else:
        response = HttpResponse(state.body, status=200, content_type="application/json")
    response["ETag"] = state.etag
    response["Cache-Control"] = "no-cache"
    if wait is not None:
        response["Preference-Applied"] = f"wait={wait}"
        response["Vary"] = "Prefer"
    return response


_RUN_PREFER_DOC = {
    **_PREFER_DOC_BASE,
    "description": "`wait=N` (N ≤ 60): hold the request until the run changes (with "
    "If-None-Match: while its ETag still matches; without: while it is `pending_approval`) "
    "or N seconds pass. Answered with `Preference-Applied: wait=N`.",
}
_RUN_IF_NONE_MATCH_DOC = {
    **_PREFER_DOC_BASE,
    "name": "If-None-Match",
    "description": "The run ETag you hold: 304 while unchanged; with Prefer: wait, held "
    "while unchanged. A malformed value is ignored.",
}


@router.get(
    "/runs/{run_id}",
    auth=any_token_or_ended_run,
    response={200: RunOut, 304: None, **errors(400, 401, 403, 404, 422)},
    summary="Read a run (long-poll with Prefer: wait=N)",
    description="A run token reads its own run, also after the run ended (`status` and "
    "`status_reason` say why). The `ETag` changes with the run's status; an agent waits for "
    "its run's approval with `Prefer: wait=N` and `If-None-Match`, as for actions.",
    tags=["runs"],
    openapi_extra={
        "parameters": [_RUN_PREFER_DOC, _RUN_IF_NONE_MATCH_DOC],
        "responses": {
            "200": {
                "description": "The run",
                "headers": {
                    "ETag": {"schema": {"type": "string"}},
                    "Preference-Applied": {"schema": {"type": "string"}},
                },
            },
            "304": {"description": "Not modified (ETag still matches If-None-Match)"},
        },
    },
)
async def run_get(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    principal = principal_of(request)
    wait = parse_prefer_wait(request.headers.get("Prefer"))
    condition = action_services.read_condition(request.headers.get("If-None-Match"))
    read = sync_to_async(_run_state)
    if not wait:
        return _run_response(await read(principal, run_id, False), condition, wait)
    # Subscribe before the first read, so a change committed in between still wakes us.
    event, live = await action_waiters.register_run(run_id)
    try:
        state = await read(principal, run_id, True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        action_waiters.held += 1
        try:
            while _run_should_hold(state, condition):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                timeout = min(remaining, SAFETY_RECHECK_SECONDS if live else 1.0)
                if state.expires_at is not None:
                    until_expiry = (state.expires_at - timezone.now()).total_seconds()
                    timeout = max(0.0, min(timeout, until_expiry + 0.05))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=timeout)
                event.clear()
                state = await read(principal, run_id, True)
        finally:
            action_waiters.held -= 1
    finally:
        action_waiters.unregister_run(run_id, event)
    return _run_response(state, condition, wait)


@router.post(
    "/runs/{run_id}/heartbeat",
    auth=agent_or_run_token,
    response={200: RunOut, **errors(401, 403, 404, 409, 422, 429)},
    summary="Extend the run's expiry (never past its approved maximum)",
    tags=["runs"],
)
def run_heartbeat(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    principal = principal_of(request)
    run = _run_for(principal, run_id)
    rate_limit_writes(principal)
    run = run_services.run_heartbeat(run=run, actor=principal.actor)
    return json_response(run_json(run))


@router.post(
    "/runs/{run_id}/finish",
    auth=agent_or_run_token,
    response={200: RunOut, **errors(401, 403, 404, 409, 422, 429)},
    summary="End the run and free its ownership records",
    tags=["runs"],
)
def run_finish(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    principal = principal_of(request)
    run = _run_for(principal, run_id)
    rate_limit_writes(principal)
    run = run_services.run_finish(run=run, actor=principal.actor)
    return json_response(run_json(run))


class RevokeIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    reason: str = Field(..., min_length=1, max_length=1000, pattern=r"^[^\x00]*\S[^\x00]*$")


@router.post(
    "/runs/{run_id}/revoke",
    auth=RoleBearer(can_decide_approvals, "Revoking a run needs the operator role."),
    response={200: RunOut, **errors(400, 401, 403, 404, 409, 413, 422, 429)},
    summary="Revoke a run (operators): ownership freed, unexecuted actions cancelled",
    tags=["runs"],
)
def run_revoke(request: HttpRequest, run_id: uuid.UUID, payload: RevokeIn) -> HttpResponse:
    principal = principal_of(request)
    run = Run.objects.select_related("agent").filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"Run {run_id} not found.")
    rate_limit_writes(principal)
    run = run_services.run_revoke(run=run, actor=principal.actor, reason=payload.reason)
    return json_response(run_json(run))


# --- Actions -------------------------------------------------------------------


def _refuse_ended_run(principal: Principal) -> None:
    """A write with the token of a run that is not active: 409 run_not_active."""
    if principal.kind != "run" or principal.run is None:
        return
    status = run_services.run_effective_status(principal.run)
    if status != RunStatus.ACTIVE:
        raise run_services.RunNotActive(
            f"Run {principal.run.pk} is {status}; only active runs write.",
            extra={"run": str(principal.run.pk), "run_status": status},
        )


_WAIT = re.compile(r"^\s*wait\s*=\s*(\d{1,6})\s*$", re.I)


def parse_prefer_wait(raw: str | None) -> int | None:
    """`Prefer: wait=N` (RFC 7240); other preferences are ignored. N over 60 is
    honoured as 60 (Preference-Applied says so). A malformed wait is a 400."""
    if not raw:
        return None
    wait: int | None = None
    for preference in raw.split(","):
        token = preference.split(";", 1)[0]
        if token.split("=", 1)[0].strip().lower() == "wait":
            match = _WAIT.match(token)
            if match is None:
                raise ApiError(
                    "Prefer: wait must be a whole number of seconds, e.g. wait=30.",
                    code="bad_header",
                    extra={"header": "Prefer"},
                )
            wait = min(int(match.group(1)), MAX_WAIT_SECONDS)
    return wait


@dataclass(frozen=True)
class ActionState:
    etag: str
    final: bool
    body: bytes  # empty when the answer will not need it (304, or still holding)


def _action_head(principal: Principal, action_id: uuid.UUID) -> tuple[str, bool]:
    """One indexed read: the action's ETag and finality, after the read permission."""
    row = (
        Action.objects.filter(pk=action_id)
        .values_list("agent_id", "run_id", "kind__owner_group", "revision", "status")
        .first()
    )
    if row is None:
        raise NotFound(f"Action {action_id} not found.")
    agent_id, run_id, owner_group, revision, status = row
    if principal.kind in ("agent", "run"):
        allowed = principal.agent is not None and principal.agent.pk == agent_id
        if allowed and run_has_ended(principal):
            # An ended run's token learns only about its own run's actions.
            allowed = principal.run is not None and principal.run.pk == run_id
    else:
        from approvals.selectors import action_list_for_actor
        from console.permissions import user_groups

        allowed = (
            can_read_everything(principal.user)
            or owner_group in user_groups(principal.user)
            or action_list_for_actor(principal.user).filter(pk=action_id).exists()
        )
    if not allowed:
        raise NotFound(f"Action {action_id} not found.")
    return f'"a{revision}"', status in FINAL_ACTION_STATUSES


def _action_state(
    principal: Principal,
    action_id: uuid.UUID,
    condition: action_services.TagCondition | None,
    hold: bool,
    close: bool,
) -> ActionState:
    """Read the action; build the body only when the answer is a 200 now.

    The hot poll path (If-None-Match still current, or a waiter re-checking
    after a wake-up) costs one indexed read.
    """
    try:
        etag, final = _action_head(principal, action_id)
        state = ActionState(etag=etag, final=final, body=b"")
        if hold and _should_hold(state, condition):
            return state
        if condition is not None and condition.weak_match(etag):
            return state
        action = _load_action(action_id)
        return ActionState(etag=action.etag, final=action.is_final, body=action_body(action))
    finally:
        if close and not connection.in_atomic_block:
            # Hand the connection back (to the pool) before the request waits.
            connection.close()


def _should_hold(state: ActionState, condition: action_services.TagCondition | None) -> bool:
    if condition is not None:
        return condition.weak_match(state.etag)
    return not state.final


def _action_response(
    state: ActionState,
    condition: action_services.TagCondition | None,
    wait: int | None,
) -> HttpResponse:
    headers = {"ETag": state.etag, "Cache-Control": "no-cache"}
    if wait is not None:
        headers["Preference-Applied"] = f"wait={wait}"
        headers["Vary"] = "Prefer"
    if condition is not None and condition.weak_match(state.etag):
        response = HttpResponse(status=304)
        for name, value in headers.items():
            response[name] = value
        return response
    response = HttpResponse(state.body, status=200, content_type="application/json")
    for name, value in headers.items():
        response[name] = value
    return response


_PREFER_DOC = {
    "in": "header",
    "name": "Prefer",
    "required": False,
    "schema": {"type": "string"},
    "description": "`wait=N` (N ≤ 60): hold the request until the action changes (see "
    "If-None-Match) or N seconds pass. Answered with `Preference-Applied: wait=N`.",
}
_IF_NONE_MATCH_DOC = {
    "in": "header",
    "name": "If-None-Match",
    "required": False,
    "schema": {"type": "string"},
    "description": "The action ETag you hold: 304 while unchanged; with Prefer: wait, held "
    "while unchanged. A malformed value is ignored.",
}


@router.get(
    "/actions/{action_id}",
    auth=any_token_or_ended_run,
    response={200: ActionOut, 304: None, **errors(400, 401, 403, 404, 422)},
    summary="Read an action (long-poll with Prefer: wait=N)",
    description="An agent token or an active run's token reads the agent's actions; the "
    "token of an ended run reads only that run's actions.",
    tags=["actions"],
    openapi_extra={
        "parameters": [_PREFER_DOC, _IF_NONE_MATCH_DOC],
        "responses": {
            "200": {
                "description": "The action",
                "headers": {
                    "ETag": {"schema": {"type": "string"}},
                    "Preference-Applied": {"schema": {"type": "string"}},
                },
            },
            "304": {"description": "Not modified (ETag still matches If-None-Match)"},
        },
    },
)
async def action_get(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    principal = principal_of(request)
    wait = parse_prefer_wait(request.headers.get("Prefer"))
    condition = action_services.read_condition(request.headers.get("If-None-Match"))
    read = sync_to_async(_action_state)
    if not wait:
        state = await read(principal, action_id, condition, False, False)
        return _action_response(state, condition, wait)
    # Subscribe before the first read, so a change committed in between still wakes us.
    event, live = await action_waiters.register(action_id)
    try:
        state = await read(principal, action_id, condition, True, True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        action_waiters.held += 1
        try:
            while _should_hold(state, condition):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                recheck = SAFETY_RECHECK_SECONDS if live else 1.0
                try:
                    await asyncio.wait_for(event.wait(), timeout=min(remaining, recheck))
                except TimeoutError:
                    if remaining <= recheck:
                        break
                event.clear()
                state = await read(principal, action_id, condition, True, True)
        finally:
            action_waiters.held -= 1
    finally:
        action_waiters.unregister(action_id, event)
    if not state.body and not (condition is not None and condition.weak_match(state.etag)):
        # Timed out holding an unfinished action without If-None-Match: answer its state.
        state = await read(principal, action_id, condition, False, False)
    return _action_response(state, condition, wait)


@router.get(
    "/actions",
    auth=any_token,
    response={200: ActionPage, **errors(400, 401, 422)},
    summary="List actions visible to the caller, newest first",
    tags=["actions"],
)
def action_list(
    request: HttpRequest,
    run: uuid.UUID | None = None,
    status: str | None = Query(None, max_length=20),
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=TIME_CURSOR_PATTERN),
) -> HttpResponse:
    principal = principal_of(request)
    actions = Action.objects.select_related("kind", "conflict_class", "run__agent")
    if principal.kind in ("agent", "run"):
        actions = actions.filter(agent=principal.agent)
    else:
        from approvals.selectors import action_list_for_actor

        actions = action_list_for_actor(principal.user).select_related(
            "kind", "conflict_class", "run__agent"
        )
    if run is not None:
        actions = actions.filter(run_id=run)
    if status:
        actions = actions.filter(status=status)
    page, next_cursor = time_page(actions, cursor=cursor, limit=limit)
    return json_response({"items": [action_json(a) for a in page], "next": next_cursor})


@router.post(
    "/actions/{action_id}/cancel",
    auth=any_token_or_ended_run,
    response={200: ActionOut, **errors(401, 403, 404, 409, 422, 429)},
    summary="Cancel an action before its execution starts",
    description="With the token of a run that is no longer active: `409 run_not_active`.",
    tags=["actions"],
)
def action_cancel(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    principal = principal_of(request)
    action = action_services.action_get_for(principal, action_id)
    if principal.kind == "person" and not can_decide_approvals(principal.user):
        raise ApiError("Cancelling needs the operator role.", code="forbidden")
    if principal.kind == "run" and principal.run is not None and principal.run.pk != action.run_id:
        raise NotFound(f"Action {action_id} not found.")
    _refuse_ended_run(principal)
    rate_limit_writes(principal)
    action = action_services.action_cancel(action=action, actor=principal.actor)
    action = _load_action(action.pk)
    return json_response(action_json(action), headers={"ETag": action.etag})


@router.post(
    "/actions/{action_id}/undo",
    auth=run_or_person_token,
    response={202: ActionOut, **errors(400, 401, 403, 404, 409, 413, 422, 429)},
    summary="Undo an applied action inside its undo window",
    description="Checked in this order: authentication -> the action exists and is visible "
    "(404) -> permission (403) -> the run token's run is active (409 run_not_active) -> "
    "Idempotency-Key (400) -> idempotency (the same key and request replay the first "
    "answer, status and body, with `Idempotent-Replayed: true`; the same key for another "
    "action or body: 422 `idempotency_key_reused`; still in flight: 409) -> undo window "
    "(409, judged when the undo is accepted). Keys are scoped to the agent (run token) or "
    "to the person (personal token).",
    tags=["actions"],
    openapi_extra={
        "parameters": [
            {
                "in": "header",
                "name": "Idempotency-Key",
                "required": True,
                "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._:-]{8,255}$"},
            }
        ],
        "responses": {
            "202": {
                "description": "Accepted: the action, with its undo's state in `undo`",
                "headers": {
                    "Location": {"schema": {"type": "string"}},
                    "Idempotent-Replayed": {
                        "schema": {"type": "string"},
                        "description": "`true` on a replay of the first answer",
                    },
                },
            }
        },
    },
)
def action_undo(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    from approvals.services.undo import action_undo_request
    from console.permissions import can_undo_as_person

    principal = principal_of(request)
    # Authorisation and 404 before the Idempotency-Key (the contract's precedence).
    action = Action.objects.select_related("kind", "resource").filter(pk=action_id).first()
    if action is None:
        raise NotFound(f"Action {action_id} not found.")
    if principal.kind == "run":
        assert principal.run is not None
        if principal.run.pk != action.run_id:
            raise NotFound(f"Action {action_id} not found.")
        _refuse_ended_run(principal)
    else:
        owner_group = action.resource.owner_group if action.resource else action.kind.owner_group
        if not can_undo_as_person(principal.user, owner_group=owner_group):
            if not action_services.action_readable_by(action, principal):
                raise NotFound(f"Action {action_id} not found.")
            raise ApiError(
                "Undo needs the operator role or membership of the resource's owner group.",
                code="forbidden",
            )
    rate_limit_writes(principal)
    key = idempotency.key_check(request.headers.get("Idempotency-Key"))
    actor = principal.actor
    # Exactly like a write: the same key and request replay the first answer; the
    # same key for another action (another path) is 422 idempotency_key_reused.
    body = read_body(request)
    fingerprint = idempotency.request_fingerprint(method="POST", path=request.path, body=body)
    begin = idempotency.idempotency_begin(
        agent=principal.agent if principal.kind == "run" else None,
        person=principal.user if principal.kind == "person" else None,
        key=key,
        method="POST",
        path=request.path,
        fingerprint=fingerprint,
    )
    if begin.replay is not None:
        return replay_response(begin.replay)
    assert begin.record_id is not None
    try:
        # The undo request and its stored answer commit together (or neither).
        with transaction.atomic():
            action_undo_request(action_id=action_id, actor=actor, idempotency_key=key)
            action = _load_action(action_id)
            response = json_response(
                action_json(action),
                status=202,
                headers={"Location": f"/api/v1/actions/{action.pk}", "ETag": action.etag},
            )
            stored = idempotency.StoredResponse(
                status=202,
                headers={
                    "Content-Type": response["Content-Type"],
                    "Location": response["Location"],
                    "ETag": response["ETag"],
                },
                body=response.content,
            )
            idempotency.idempotency_complete(
                record_id=begin.record_id, response=stored, action_id=action.pk
            )
    except BaseException:
        idempotency.idempotency_release(record_id=begin.record_id)
        raise
    return response


# --- Approvals -----------------------------------------------------------------


def _approval_item(approval: Approval) -> dict[str, Any]:
    from console.core.barrier import proposed_document
    from ownership.diff import three_way_diff
    from ownership.models import Resource

    run = approval.run
    approvers = approval.decisions.filter(decision=Decision.APPROVE).count()
    item: dict[str, Any] = {
        "id": str(approval.pk),
        "subject": approval.subject,
        "run": str(run.pk),
        "action": str(approval.action_id) if approval.action_id else None,
        "agent": run.agent.name,
        "task": run.task,
        "write_set": run.write_set if approval.subject == ApprovalSubject.RUN else None,
        "resource": None,
        "operation": None,
        "conflict_class": None,
        "diff": None,
        "observed_etag": None,
        "current_etag": None,
        "approvals_so_far": approvers,
        "quorum": approval.quorum,
        "expires_at": iso(approval.expires_at),
        "status": approval.status,
        "created_at": iso(approval.created_at),
    }
    action = approval.action
    if action is not None:
        resource = Resource.objects.filter(kind_id=action.kind_id, name=action.name).first()
        current = resource.document if resource is not None and not resource.deleted else {}
        proposed = proposed_document(action, current) if action.operation != "delete" else {}
        item.update(
            {
                "resource": action.resource_identifier,
                "operation": action.operation,
                "conflict_class": action.conflict_class_id,
                "observed_etag": (
                    f'"{approval.observed_version}"'
                    if approval.observed_version is not None
                    else None
                ),
                "current_etag": (
                    resource.etag if resource is not None and not resource.deleted else None
                ),
                "diff": [
                    {"path": row["path"], "current": row["current"], "proposed": row["proposed"]}
                    for row in three_way_diff(current, current, proposed)
                ],
            }
        )
    return item


@router.get(
    "/approvals",
    auth=person_token,
    response={200: ApprovalPage, **errors(400, 401, 403, 422)},
    summary="Run and call approvals the caller may decide, oldest first",
    tags=["approvals"],
)
def approval_list(
    request: HttpRequest,
    status: Literal["pending", "approved", "rejected", "expired", "cancelled"] = "pending",
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=TIME_CURSOR_PATTERN),
) -> HttpResponse:
    from approvals.selectors import approval_list_for_person

    principal = principal_of(request)
    # The console's rule: operators decide; escalation groups see escalated calls.
    approvals = approval_list_for_person(principal.user, status=status)
    page, next_cursor = time_page(approvals, cursor=cursor, limit=limit, newest_first=False)
    return json_response({"items": [_approval_item(a) for a in page], "next": next_cursor})


@router.get(
    "/approvals/{approval_id}",
    auth=person_token,
    response={200: ApprovalItem, **errors(401, 403, 404, 422)},
    summary="Read one approval",
    tags=["approvals"],
)
def approval_get(request: HttpRequest, approval_id: uuid.UUID) -> HttpResponse:
    from approvals.selectors import approval_get_for_person

    principal = principal_of(request)
    return json_response(_approval_item(approval_get_for_person(principal.user, approval_id)))


@router.post(
    "/approvals/{approval_id}/decision",
    auth=person_token,
    response={200: ApprovalItem, **errors(400, 401, 403, 404, 409, 413, 422, 429)},
    summary="Approve or reject (409 if already decided or expired)",
    tags=["approvals"],
)
def approval_decision(
    request: HttpRequest, approval_id: uuid.UUID, payload: DecisionIn
) -> HttpResponse:
    from approvals.services.decisions import approval_decide

    principal = principal_of(request)
    rate_limit_writes(principal)
    approval = approval_decide(
        approval_id=approval_id,
        actor=principal.actor,
        decision=payload.decision,
        comment=payload.comment,
    )
    approval = Approval.objects.select_related(
        "run__agent", "action__kind", "action__conflict_class"
    ).get(pk=approval.pk)
    return json_response(_approval_item(approval))


__all__ = ["RunStatus", "action_json", "router"]


# --- Auto-approve rules (admins write; operators, admins and auditors read) ---------------

_RULE_KIND_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
_MAX_RULE_ID = 2**63 - 1


class AutoApproveRuleIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    kind: str = Field(..., pattern=_RULE_KIND_PATTERN, description="A resource kind slug")
    name_prefix: str = Field(
        "",
        max_length=255,
        pattern=TEXT_PATTERN,
        description="Covers write-set entries whose name (or name prefix) starts with this; "
        "empty covers every name of the kind",
    )
    operations: list[Literal["create", "update", "delete"]] = Field(..., min_length=1, max_length=3)
    agent: str | None = Field(
        None,
        min_length=1,
        max_length=150,
        pattern=TEXT_PATTERN,
        description="Only this agent's runs (by name); null: any agent",
    )
    enabled: bool = True
    description: str = Field("", max_length=200, pattern=TEXT_PATTERN)


class AutoApproveRuleOut(Schema):
    id: int
    kind: str
    name_prefix: str
    operations: list[str]
    agent: str | None
    enabled: bool
    description: str


class AutoApproveRulePage(Schema):
    items: list[AutoApproveRuleOut]
    next: str | None


# Decided while authenticating, before query or body validation (no schema leak).
rules_reader_token = RoleBearer(
    can_read_everything, "Auto-approve rules are shown to operators, admins and auditors."
)
rules_admin_token = RoleBearer(is_admin, "Only admins edit auto-approve rules.")


def _rule_json(rule_id: int) -> dict[str, Any]:
    from approvals.models import AutoApproveRule
    from approvals.services.rules import rule_as_dict

    rule = AutoApproveRule.objects.select_related("agent").filter(pk=rule_id).first()
    if rule is None:
        raise NotFound(f"Auto-approve rule {rule_id} not found.")
    return rule_as_dict(rule)


_RULE_ID = Path(..., ge=1, le=_MAX_RULE_ID)


@router.get(
    "/auto-approve-rules",
    auth=rules_reader_token,
    response={200: AutoApproveRulePage, **errors(400, 401, 403, 422)},
    summary="Auto-approve rules (operators, admins, auditors), by id",
    tags=["auto-approve rules"],
)
def auto_approve_rule_list(
    request: HttpRequest,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=r"^[0-9]{1,19}$", description="`next` of a page"),
) -> HttpResponse:
    from approvals.models import AutoApproveRule
    from approvals.services.rules import rule_as_dict

    rules = AutoApproveRule.objects.select_related("agent").order_by("id")
    if cursor is not None:
        rules = rules.filter(id__gt=min(int(cursor), _MAX_RULE_ID))
    page = list(rules[: limit + 1])
    next_cursor = None
    if len(page) > limit:
        page = page[:limit]
        next_cursor = str(page[-1].pk)
    return json_response({"items": [rule_as_dict(rule) for rule in page], "next": next_cursor})


@router.get(
    "/auto-approve-rules/{rule_id}",
    auth=rules_reader_token,
    response={200: AutoApproveRuleOut, **errors(401, 403, 404, 422)},
    summary="One auto-approve rule",
    tags=["auto-approve rules"],
)
def auto_approve_rule_get(request: HttpRequest, rule_id: int = _RULE_ID) -> HttpResponse:
    return json_response(_rule_json(rule_id))


@router.post(
    "/auto-approve-rules",
    auth=rules_admin_token,
    response={201: AutoApproveRuleOut, **errors(400, 401, 403, 413, 422, 429)},
    summary="Create an auto-approve rule (admins; audited)",
    description="A run whose every write-set entry is covered by an enabled rule (kind, name "
    "prefix, operations, and the agent when set) is activated without a person. Unknown kinds "
    "or agents are 422.",
    tags=["auto-approve rules"],
)
def auto_approve_rule_post(request: HttpRequest, payload: AutoApproveRuleIn) -> HttpResponse:
    from approvals.services.rules import auto_approve_rule_create

    principal = principal_of(request)
    rate_limit_writes(principal)
    rule = auto_approve_rule_create(actor=principal.actor, **payload.model_dump())
    body = _rule_json(rule.pk)
    return json_response(
        body, status=201, headers={"Location": f"/api/v1/auto-approve-rules/{rule.pk}"}
    )


@router.put(
    "/auto-approve-rules/{rule_id}",
    auth=rules_admin_token,
    response={200: AutoApproveRuleOut, **errors(400, 401, 403, 404, 413, 422, 429)},
    summary="Replace an auto-approve rule (admins; audited when something changed)",
    tags=["auto-approve rules"],
)
def auto_approve_rule_put(
    request: HttpRequest, payload: AutoApproveRuleIn, rule_id: int = _RULE_ID
) -> HttpResponse:
    from approvals.services.rules import auto_approve_rule_update

    principal = principal_of(request)
    rate_limit_writes(principal)
    auto_approve_rule_update(actor=principal.actor, rule_id=rule_id, **payload.model_dump())
    return json_response(_rule_json(rule_id))


@router.delete(
    "/auto-approve-rules/{rule_id}",
    auth=rules_admin_token,
    response={204: None, **errors(401, 403, 404, 422, 429)},
    summary="Delete an auto-approve rule (admins; audited)",
    tags=["auto-approve rules"],
)
def auto_approve_rule_delete(request: HttpRequest, rule_id: int = _RULE_ID) -> HttpResponse:
    from approvals.services.rules import auto_approve_rule_delete as delete_rule

    principal = principal_of(request)
    rate_limit_writes(principal)
    if not delete_rule(actor=principal.actor, rule_id=rule_id):
        raise NotFound(f"Auto-approve rule {rule_id} not found.")
    return HttpResponse(status=204)
