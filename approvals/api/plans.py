"""API: plans — propose one (`POST /runs/{id}/plans`, with an Idempotency-Key) and read
it (`GET /plans/{id}`, ETag and long-poll like an action).

The proposal is checked like a single write, step by step (run active, write set,
If-Match syntax and freshness), and recorded whole or not at all
(approvals/services/plans.py); the engine (plan_engine.py) runs it.
"""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from ninja import Field, Router, Schema
from pydantic import ConfigDict

from approvals.api.longpoll import (
    hold,
    longpoll_read,
    parse_prefer_wait,
    release_connection,
)
from approvals.models import ApprovalStatus, PayloadFormat, Plan, PlanStep, Run
from approvals.selectors import plan_detail, plan_step_resources, plans_visible_to
from approvals.services import actions as action_services
from approvals.services import idempotency, preconditions
from approvals.services.plans import (
    PlanStepSpec,
    StepPreview,
    max_plan_steps,
    plan_propose,
    plan_step_preview,
)
from approvals.services.preconditions import TagCondition, read_condition
from audit.services import Actor
from console.api_support import (
    TEXT_PATTERN,
    conditional_response,
    idempotency_claim,
    json_bytes,
    json_response,
    propose_for_replay,
    rate_limit_writes,
    read_body,
)
from console.auth import (
    any_token_or_ended_run,
    principal_of,
    principal_resolve,
    reader_of,
    run_token,
)
from console.problems import errors
from engine.core.errors import DomainError, NotFound, ValidationFailed
from ownership.api.schemas import STRONG_ETAG_PATTERN
from ownership.models import ConflictOrigin, ResourceKind

router = Router(tags=["plans"])

STEP_RESOURCE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}/[A-Za-z0-9][A-Za-z0-9._:@+=,-]{0,254}$"


class CompensationIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal["PUT", "PATCH", "DELETE"]
    document: dict[str, Any] | None = Field(None, description="PUT: the full document")
    patch: dict[str, Any] | None = Field(None, description="PATCH: a JSON merge patch")


class PlanStepIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    resource: str = Field(..., pattern=STEP_RESOURCE_PATTERN, examples=["release/web"])
    method: Literal["PUT", "PATCH", "DELETE"]
    if_match: str | None = Field(
        None,
        pattern=STRONG_ETAG_PATTERN,
        description='The ETag you read (one strong tag, e.g. "\\"3\\""): updates and deletes',
    )
    if_none_match: Literal["*"] | None = Field(None, description="`*`: create (with PUT)")
    document: dict[str, Any] | None = Field(None, description="PUT: the full document")
    patch: dict[str, Any] | None = Field(None, description="PATCH: a JSON merge patch")
    compensation: CompensationIn | None = Field(
        None,
        description="What undoes this step if a later one fails for good: a conditional write "
        "against the version this step produced. Default: the undo of the step (the document "
        "from before it; for a create, its deletion).",
    )


class PlanCreateIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    reason: str = Field("", max_length=500, pattern=TEXT_PATTERN)
    steps: list[PlanStepIn] = Field(
        ..., min_length=1, max_length=max_plan_steps(), description="In order"
    )


class PlanStepOut(Schema):
    position: int
    resource: str
    operation: Literal["create", "update", "delete"]
    observed_etag: str | None
    observed_recorded: bool = Field(
        ..., description="False when the observed version's document is not on record"
    )
    conflict_class: str
    status: Literal["pending", "executing", "applied", "refused", "skipped"]
    document: dict[str, Any] | None = Field(None, description="PUT: the full document")
    patch: dict[str, Any] | None = Field(None, description="PATCH: the merge patch")
    diff: list[dict[str, Any]] = Field(
        ..., description="What the step changes: the version observed -> after the step"
    )
    action: dict[str, Any] | None
    applied: dict[str, Any] | None
    compensation: dict[str, Any]
    error: dict[str, Any] | None


class PlanLink(Schema):
    id: uuid.UUID
    url: str


class PlanEditOut(Schema):
    model_config = ConfigDict(extra="allow")

    by: str | None
    supersedes: uuid.UUID
    step: int
    resource: str
    comment: str
    diff: list[dict[str, Any]]


class PlanOut(Schema):
    id: uuid.UUID
    url: str
    run: uuid.UUID
    agent: str
    status: Literal[
        "pending_approval",
        "executing",
        "compensating",
        "applied",
        "compensated",
        "partially_compensated",
        "rejected",
        "expired",
        "cancelled",
        "superseded",
    ]
    reason: str
    error: dict[str, Any] | None
    approval: dict[str, Any] | None
    superseded_by: PlanLink | None = Field(
        None,
        description="A `superseded` plan: the plan a person approved with one step edited "
        "instead (nothing of this one ran); follow it",
    )
    edited: PlanEditOut | None = Field(
        None,
        description="A plan a person edited before approving: who, the plan it replaced, "
        "the step and the diff from the agent's step to the approved one",
    )
    steps: list[PlanStepOut]
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None


# --- Serialisation -------------------------------------------------------------------


def _compensation_json(step: PlanStep, preview: StepPreview) -> dict[str, Any]:
    """The compensation as the agent gave it (or the undo), the write it is and its
    class, and what it leaves as a diff against the version observed."""
    given = step.compensation if isinstance(step.compensation, dict) else {}
    return {
        "method": given.get("method", "undo"),
        **{key: given[key] for key in ("document", "patch") if key in given},
        "operation": given.get("operation"),
        "conflict_class": given.get("conflict_class"),
        "deletes": preview.compensation_deletes,
        "diff": preview.compensation_diff,
    }


def _step_json(step: PlanStep, conflicts: dict[Any, Any], preview: StepPreview) -> dict[str, Any]:
    applied = step.applied_operation
    forward_conflict = conflicts.get((step.action_id, ConflictOrigin.WRITE))
    undo_conflict = (
        conflicts.get((applied.action_id, ConflictOrigin.UNDO)) if applied is not None else None
    )
    undo_op = step.compensation_operation
    return {
        "position": step.position,
        "resource": step.resource_identifier,
        "operation": step.operation,
        "observed_etag": (None if step.observed_version is None else f'"{step.observed_version}"'),
        "observed_recorded": preview.observed_recorded,
        "conflict_class": step.conflict_class_id,
        "status": step.status,
        **({"document": step.payload} if step.payload_format == PayloadFormat.REPLACE else {}),
        **({"patch": step.payload} if step.payload_format == PayloadFormat.MERGE_PATCH else {}),
        "diff": preview.diff,
        "action": (
            {"id": str(step.action_id), "url": f"/api/v1/actions/{step.action_id}"}
            if step.action_id
            else None
        ),
        "applied": (
            {
                "by_action": str(applied.action_id),
                "operation": applied.pk,
                "fence": applied.fence,
                "base_version": applied.base_version,
                "result_version": applied.result_version,
            }
            if applied is not None
            else None
        ),
        "compensation": {
            **_compensation_json(step, preview),
            "status": step.compensation_status or "none",
            "undo_operation": undo_op.pk if undo_op is not None else None,
            "result_version": undo_op.result_version if undo_op is not None else None,
            "conflict": str(undo_conflict.pk) if undo_conflict is not None else None,
        },
        "error": (
            {**step.error, **({"conflict": str(forward_conflict.pk)} if forward_conflict else {})}
            if isinstance(step.error, dict)
            else None
        ),
    }


def _edit_json(plan: Plan) -> dict[str, Any] | None:
    """Who edited the plan and how (approvals/services/plan_edits.py): None if nobody did."""
    if not isinstance(plan.edit, dict):
        return None
    keys = ("by", "supersedes", "step", "resource", "comment", "diff")
    return {key: plan.edit.get(key) for key in keys}


def plan_json(plan: Plan) -> dict[str, Any]:
    detail = plan_detail(plan)
    approval = detail["approval"]
    resources = plan_step_resources(detail["steps"])
    return {
        "id": str(plan.pk),
        "url": f"/api/v1/plans/{plan.pk}",
        "run": str(plan.run_id),
        "agent": plan.agent.name,
        "status": plan.status,
        "reason": plan.reason,
        "error": plan.error,
        "approval": (
            {
                "id": str(approval.pk),
                "status": approval.status,
                "quorum": approval.quorum,
                "approvals": sum(1 for d in approval.decisions.all() if d.decision == "approve"),
                "expires_at": (
                    approval.expires_at.isoformat()
                    if approval.status == ApprovalStatus.PENDING
                    else None
                ),
            }
            if approval is not None
            else None
        ),
        "superseded_by": (
            {"id": str(plan.superseded_by_id), "url": f"/api/v1/plans/{plan.superseded_by_id}"}
            if plan.superseded_by_id
            else None
        ),
        "edited": _edit_json(plan),
        "steps": [
            _step_json(
                step,
                detail["conflicts"],
                plan_step_preview(step, resources.get((step.kind_id, step.name))),
            )
            for step in detail["steps"]
        ],
        "created_at": plan.created_at.isoformat(),
        "updated_at": plan.updated_at.isoformat(),
        "ended_at": plan.ended_at.isoformat() if plan.ended_at else None,
    }


# --- Propose -------------------------------------------------------------------------


def _step_spec(run: Run, position: int, step: PlanStepIn) -> PlanStepSpec:
    """One step as a single write's Proposal, checked in the single write's order
    (run active, kind, write set, If-Match); every refusal names its step."""
    kind, _, name = step.resource.partition("/")
    if step.if_none_match is not None and step.method != "PUT":
        raise _field_error(position, "if_none_match", "only '*' with PUT (create)")
    operation = action_services.write_operation(step.method, create=step.if_none_match == "*")
    needs = {"PUT": "document", "PATCH": "patch"}.get(step.method)
    for field in ("document", "patch"):
        given = getattr(step, field) is not None
        if given != (field == needs):
            message = (
                f"{step.method} needs {field}" if not given else f"{step.method} takes no {field}"
            )
            raise _field_error(position, field, message)
    try:
        resource_kind: ResourceKind = action_services.action_check_writable(
            run=run, kind=kind, name=name, operation=operation
        )
        if_match = preconditions.parse_write_if_match(step.if_match)
    except DomainError as error:
        error.extra = {**(error.extra or {}), "step": position}
        raise
    if operation == "create" and if_match is not None:
        raise _field_error(position, "if_match", "a create takes if_none_match '*' only")
    return PlanStepSpec(
        proposal=action_services.Proposal(
            kind=resource_kind,
            name=name,
            operation=operation,
            payload_format=action_services.PAYLOAD_FORMATS[step.method],
            payload=step.document if step.method == "PUT" else step.patch,
            if_match=if_match,
            create_if_absent=operation == "create",
            idempotency_key="",
            reason="",
        ),
        compensation=(
            step.compensation.model_dump(exclude_none=True) if step.compensation else None
        ),
    )


def _field_error(position: int, field: str, message: str) -> ValidationFailed:
    return ValidationFailed(
        f"step {position}: {message}",
        extra={"errors": [{"field": f"steps[{position - 1}].{field}", "message": message}]},
    )


@router.post(
    "/runs/{run_id}/plans",
    auth=run_token,
    response={202: PlanOut, **errors(400, 401, 403, 404, 409, 412, 413, 422, 423, 428, 429, 502)},
    summary="Propose a plan: several conditional writes approved as one, applied in order",
    description="Every step is checked like a single write (run active, write set, "
    "If-Match) and the plan is recorded whole or not at all: a step outside the write set "
    "(403), a duplicate resource or more than `AIRLOCK_PLAN_MAX_STEPS` steps (422), a "
    "stale tag (412, naming the `step`) record nothing. An explicit compensation is checked "
    "as the write it is: its operation in the write set (403 with `field: compensation`), "
    "its class counted with the steps'. Needs an Idempotency-Key. The plan runs at once "
    "when every step's and compensation's class is per-run; one per-call class makes the "
    "whole plan wait for one approval with the strictest class's quorum. A step may be on "
    "any target (managed, http, postgres, git; mixed): each external step's document is read "
    "from its target first (502 `target_unavailable` / `weak_validator` naming the `step` "
    "when it cannot be), and it executes and is compensated through the target's own "
    "conditional write. Poll `GET /plans/{id}`.",
    openapi_extra={
        "parameters": [
            {
                "in": "header",
                "name": "Idempotency-Key",
                "required": True,
                "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._:-]{8,255}$"},
                "description": "Scoped to the agent, kept at least 24 h. A retry with the same "
                "key and body replays the original answer (`Idempotent-Replayed: true`).",
            }
        ]
    },
)
def plan_create(request: HttpRequest, run_id: uuid.UUID, payload: PlanCreateIn) -> HttpResponse:
    principal = principal_of(request)
    run = principal.run
    assert run is not None and principal.agent is not None
    if run.pk != run_id:
        raise NotFound(f"Run {run_id} not found.")
    rate_limit_writes(principal)
    key = idempotency.key_check(request.headers.get("Idempotency-Key"))
    steps = [_step_spec(run, n, step) for n, step in enumerate(payload.steps, start=1)]
    record_id = idempotency_claim(
        request,
        actor=Actor.agent(principal.agent),  # keys belong to the agent, not the run
        key=key,
        method="POST",
        body=read_body(request),
    )
    if isinstance(record_id, HttpResponse):
        return record_id  # the replayed answer

    def render(plan: Plan) -> tuple[HttpResponse, Any]:
        recorded = Plan.objects.select_related("agent").get(pk=plan.pk)
        headers = {"ETag": recorded.etag, "Location": f"/api/v1/plans/{recorded.pk}"}
        return json_response(plan_json(recorded), status=202, headers=headers), None

    return propose_for_replay(
        record_id,
        lambda on_recorded, on_refused: plan_propose(
            run=run,
            steps=steps,
            reason=payload.reason,
            idempotency_key=key,
            on_recorded=on_recorded,
            on_refused=on_refused,
        ),
        render,
    )


# --- Read, with long-poll ------------------------------------------------------------


@dataclass(frozen=True)
class PlanState:
    etag: str
    final: bool
    run_id: uuid.UUID | None
    body: bytes


def _should_hold(state: PlanState, condition: TagCondition | None) -> bool:
    if condition is not None:
        return condition.weak_match(state.etag)
    return not state.final


def _plan_state(
    request: HttpRequest, plan_id: uuid.UUID, condition: TagCondition | None, holding: bool
) -> PlanState:
    try:
        principal = principal_resolve(request)
        plan = plans_visible_to(reader_of(principal)).filter(pk=plan_id).first()
        if plan is None:
            raise NotFound(f"Plan {plan_id} not found.")
        state = PlanState(etag=plan.etag, final=plan.is_final, run_id=plan.run_id, body=b"")
        if (holding and _should_hold(state, condition)) or (
            condition is not None and condition.weak_match(state.etag)
        ):
            return state
        return PlanState(
            etag=plan.etag,
            final=plan.is_final,
            run_id=plan.run_id,
            body=json_bytes(plan_json(plan)),
        )
    finally:
        release_connection(holding)


@longpoll_read(
    router,
    "/plans/{plan_id}",
    out=PlanOut,
    subject="plan",
    auth=any_token_or_ended_run,
    summary="Read a plan (long-poll with Prefer: wait=N)",
    description="The plan with every step's state, its approval and compensations. Held "
    "with `Prefer: wait=N` while the ETag still matches If-None-Match, or (without it) "
    "while the plan has not ended (`applied`, `compensated`, `rejected`, `expired`, `cancelled`, "
    "`superseded`: a person approved it with a step edited, and `superseded_by` links the "
    "edited plan). A stopped plan (`compensated` included) compensates again when the "
    "outcome of a refused step's write, unknown when it failed, is later read as applied: "
    "that step becomes `applied` with `error.settled_late`, and its compensation shows as "
    "any other's.",
)
async def plan_get(request: HttpRequest, plan_id: uuid.UUID) -> HttpResponse:
    wait = parse_prefer_wait(request.headers.get("Prefer"))
    condition = read_condition(request.headers.get("If-None-Match"))
    read = sync_to_async(_plan_state)
    state = await read(request, plan_id, condition, False)
    if wait and _should_hold(state, condition) and state.run_id is not None:
        # A plan's changes are published on its run's channel.
        state = await hold(
            channel=state.run_id,
            run=True,
            wait=wait,
            read=lambda woken: read(request, plan_id, condition, True),
            should_hold=lambda state: _should_hold(state, condition),
        )
        if not state.body and not (condition and condition.weak_match(state.etag)):
            state = await read(request, plan_id, condition, False)
    return conditional_response(etag=state.etag, body=state.body, condition=condition, wait=wait)
