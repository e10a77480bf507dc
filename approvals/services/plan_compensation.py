"""A plan's compensation: its applied steps undone in strict reverse order, each by a
write that is checked like any other (docs/plans-compensation.md).

- Strict reverse order: a step's compensation starts only once every later step's is
  settled (compensated, or a person's conflict resolved). While a later one is an open
  conflict or failed, the earlier steps wait; the plan is `partially_compensated`.
- Its own record: each compensation is a new undo operation (`Operation.compensation`,
  `restore` for an explicit compensation). It never takes over someone's earlier undo:
  a failed one stays as it was; a live one (someone asked to undo the step's write and
  it is on its way) is waited for, and when it has undone the write there is nothing
  left to compensate.
- Its guard is the version the step produced (the undo core's conditional write
  against `applied_operation.result_version`); a later write makes it a conflict.
- It waits for a person instead of writing when no one approved its effect: the step
  applied through a person's conflict resolution (the agent's pre-image must not erase
  what the resolver chose), or the compensation's own class is per-call and the plan
  had no approval. It is then a conflict (origin `undo`) whose three-way page shows
  base = the version before the step, current, proposed = the compensation.
- A person's resolution is followed to its end: a resolution whose write is itself
  refused as stale becomes a new conflict, and so on (`resolution_trail`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from django.db import IntegrityError, transaction
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Approval,
    ApprovalStatus,
    CompensationStatus,
    Operation,
    OperationStatus,
    Plan,
    PlanStatus,
    PlanStep,
    PlanStepStatus,
)
from approvals.outbox import enqueue_undo_execution
from approvals.services.external_undo import undo_left_unknown
from approvals.services.plan_state import plan_end, plan_event
from approvals.services.plans import compensation_operation
from engine.core.fence import next_fence
from engine.core.operations import applied_operation
from engine.core.undo import ALREADY_UNDONE, RESOURCE_MOVED
from ownership.diff import apply_merge_patch
from ownership.history import base_token, revision_at
from ownership.models import (
    ApprovalMode,
    Conflict,
    ConflictClass,
    ConflictOrigin,
    ConflictStatus,
    Resource,
)
from ownership.services.conflicts import conflict_open_for_undo

# A compensation that waits for a person (the reason on its undo operation).
APPLIED_BY_RESOLUTION = "applied_by_resolution"
NEEDS_APPROVAL = "needs_approval"
# How many resolutions of resolutions a trail follows (each one is a person's act).
MAX_RESOLUTION_CHAIN = 64

_BLOCKING = (CompensationStatus.CONFLICT, CompensationStatus.FAILED)


# --- A person's resolution, followed to its end ------------------------------------


@dataclass(frozen=True)
class ResolutionTrail:
    """Where a conflict's resolutions stand: `open` (a person decides `conflict`),
    `waiting` (a resolution's write on its way), `applied` (by `operation`), `kept`
    (the person kept the current document), `failed` (`error`)."""

    state: Literal["open", "waiting", "applied", "kept", "failed"]
    conflict: Conflict
    operation: Operation | None = None
    error: dict[str, Any] | None = None


def resolution_trail(conflict: Conflict) -> ResolutionTrail:
    """Follow `conflict`'s resolution, and the conflict of that resolution's write when
    it was itself refused as stale, until one is final (or still open)."""
    for _ in range(MAX_RESOLUTION_CHAIN):
        if conflict.status == ConflictStatus.OPEN:
            return ResolutionTrail("open", conflict)
        if conflict.resolution_action_id is None:
            return ResolutionTrail("kept", conflict)
        action = Action.objects.get(pk=conflict.resolution_action_id)
        if action.status == ActionStatus.APPLIED:
            return ResolutionTrail("applied", conflict, operation=applied_operation(action.pk))
        if action.status == ActionStatus.CONFLICT:
            following = Conflict.objects.filter(action=action, origin=ConflictOrigin.WRITE).first()
            if following is None:
                error = {"code": "stale_version", "resolution_action": str(action.pk)}
                return ResolutionTrail("failed", conflict, error=error)
            conflict = following
            continue
        if action.is_final:
            recorded = action.error if isinstance(action.error, dict) else {}
            error = {
                "code": str(recorded.get("code") or action.status),
                "resolution_action": str(action.pk),
                "action_status": action.status,
            }
            return ResolutionTrail("failed", conflict, error=error)
        return ResolutionTrail("waiting", conflict)
    return ResolutionTrail("waiting", conflict)


# --- Strict reverse order --------------------------------------------------------------


def plan_compensate(plan: Plan, steps: list[PlanStep]) -> str:
    """Compensate the applied steps, last first; stop at the first one not settled."""
    applied = [s for s in reversed(steps) if s.status == PlanStepStatus.APPLIED]
    for step in applied:
        status = step.compensation_status
        if status == CompensationStatus.NONE:
            _resume_after_block(plan, step)
            status = _start_compensation(plan, step)
            if status in (CompensationStatus.NONE, CompensationStatus.PENDING):
                return f"compensating:{step.position}"
        if status == CompensationStatus.PENDING:
            settled = _compensation_verdict(plan, step)
            if settled is None:
                return f"compensating:{step.position}"
            status = settled
        if status == CompensationStatus.CONFLICT:
            status = _check_compensation_conflict(plan, step)
        if status in _BLOCKING:
            # Strict reverse order: the earlier steps wait for this one.
            if plan.status != PlanStatus.PARTIALLY_COMPENSATED:
                plan_end(plan, PlanStatus.PARTIALLY_COMPENSATED, blocked_steps=[step.position])
            return "partially_compensated"
    plan_end(plan, PlanStatus.COMPENSATED)
    return "compensated"


def _resume_after_block(plan: Plan, step: PlanStep) -> None:
    """The later step that blocked the plan is settled: it compensates again, from
    `step` on (only when a compensation is about to start, so re-reading a blocked
    plan never flips its status)."""
    if plan.status != PlanStatus.PARTIALLY_COMPENSATED:
        return
    Plan.objects.filter(pk=plan.pk).update(status=PlanStatus.COMPENSATING, ended_at=None)
    plan.status = PlanStatus.COMPENSATING
    plan_event(plan, "plan.compensation_resumed", step)


# --- One step's compensation --------------------------------------------------------


def _restore_for(step: PlanStep, operation: Operation) -> dict[str, Any] | None:
    """The explicit compensation as the undo core's `restore`; None for a plain undo."""
    compensation = step.compensation
    if not isinstance(compensation, dict):
        return None
    method = compensation.get("method")
    if method == "DELETE":
        return {"document": {}, "deleted": True}
    if method == "PUT":
        return {"document": compensation.get("document") or {}, "deleted": False}
    resource = Resource.objects.filter(kind_id=step.kind_id, name=step.name).first()
    produced = None if resource is None else revision_at(resource, operation.result_version)
    base = produced.document if produced is not None and not produced.deleted else {}
    return {"document": apply_merge_patch(base, compensation.get("patch") or {}), "deleted": False}


def _plan_approved(plan: Plan) -> bool:
    return Approval.objects.filter(plan=plan, status=ApprovalStatus.APPROVED).exists()


def _per_call_class(step: PlanStep) -> ConflictClass | None:
    """The class of an explicit compensation when it needs a person per call (as the
    kind says now, or as recorded at proposal: the stricter); None otherwise."""
    compensation = step.compensation
    if not isinstance(compensation, dict):
        return None
    operation = str(
        compensation.get("operation")
        or compensation_operation(step.operation, str(compensation.get("method")))
    )
    now = step.kind.class_for(operation)
    recorded = ConflictClass.objects.filter(slug=str(compensation.get("conflict_class") or ""))
    for cls in [now, *recorded]:
        if cls.approval_mode == ApprovalMode.PER_CALL:
            return cls
    return None


def _needs_person(
    plan: Plan, step: PlanStep, original: Operation
) -> tuple[str, ConflictClass | None] | None:
    """(reason, class of the person's decision) when nobody approved this
    compensation's effect; None when it may run."""
    if original.action_id != step.action_id:
        return APPLIED_BY_RESOLUTION, None
    per_call = _per_call_class(step)
    if per_call is not None and not _plan_approved(plan):
        return NEEDS_APPROVAL, per_call
    return None


def _someone_elses_undo(plan: Plan, step: PlanStep, original: Operation) -> str | None:
    """Someone asked to undo the step's write (a live undo not this plan's): the
    compensation waits for it (None: still on its way, NONE kept), and once it has
    undone the write there is nothing left to compensate (COMPENSATED)."""
    live = Operation.objects.filter(undo_of=original).exclude(status=OperationStatus.FAILED).first()
    if live is None:
        return CompensationStatus.NONE
    if live.status != OperationStatus.DONE:
        return None
    PlanStep.objects.filter(pk=step.pk).update(compensation_status=CompensationStatus.COMPENSATED)
    step.compensation_status = CompensationStatus.COMPENSATED
    plan_event(
        plan,
        "plan.compensation_applied",
        step,
        reason=ALREADY_UNDONE,
        undone_by_operation=live.pk,
        result_version=live.result_version,
    )
    return CompensationStatus.COMPENSATED


def _start_compensation(plan: Plan, step: PlanStep) -> str:
    """The compensation's own undo operation (queued after commit), or its conflict
    when it waits for a person. Returns the step's compensation status (NONE: it
    waits for someone's undo of the same write)."""
    original = step.applied_operation
    assert original is not None
    before = _someone_elses_undo(plan, step, original)
    if before is None:
        return CompensationStatus.NONE
    if before == CompensationStatus.COMPENSATED:
        return before
    person = _needs_person(plan, step, original)
    now = timezone.now()
    requested = {
        "requested_by": f"plan {plan.pk}",
        "requested_by_type": "system",
        # An earlier compensation that ended unsettled may have restored it: read first.
        **undo_left_unknown(original.pk),
    }
    fields: dict[str, Any] = {
        "action_id": original.action_id,
        "undo_of": original,
        "fence": next_fence(),
        "worker": "plan-compensation",
        "accepted_at": now,
        "compensation": True,
        "restore": _restore_for(step, original),
    }
    if person is not None:
        reason, _ = person
        fields.update(
            status=OperationStatus.FAILED,
            finished_at=now,
            outcome={**requested, "reason": reason, "message": _PERSON_MESSAGES[reason]},
        )
    else:
        fields.update(status=OperationStatus.PENDING, outcome=requested)
    try:
        with transaction.atomic():
            undo_op = Operation.objects.create(**fields)
    except IntegrityError:
        return CompensationStatus.NONE  # someone's undo of this write came first: wait for it
    status = CompensationStatus.PENDING if person is None else CompensationStatus.CONFLICT
    PlanStep.objects.filter(pk=step.pk).update(
        compensation_status=status, compensation_operation=undo_op
    )
    step.compensation_status, step.compensation_operation = status, undo_op
    plan_event(
        plan,
        "plan.compensation_started",
        step,
        operation=original.pk,
        undo_operation=undo_op.pk,
        compensation=(step.compensation or {}).get("method", "undo"),
        expected_version=original.result_version,
    )
    if person is not None:
        _wait_for_person(plan, step, original, undo_op, person)
    else:
        undo_id = undo_op.pk
        transaction.on_commit(lambda: enqueue_undo_execution(undo_id))
    return status


_PERSON_MESSAGES = {
    APPLIED_BY_RESOLUTION: "the step applied through a person's conflict resolution: a person "
    "decides its compensation, which must not erase what they chose",
    NEEDS_APPROVAL: "the compensation's class needs a person's approval per call and the plan "
    "had none: a person decides it",
}


def _wait_for_person(
    plan: Plan,
    step: PlanStep,
    original: Operation,
    undo_op: Operation,
    person: tuple[str, ConflictClass | None],
) -> None:
    """The compensation as a conflict for a person: base = before the step (0: the
    step created the resource), current = now, proposed = the compensation."""
    reason, cls = person
    resource = Resource.objects.get(pk=int(undo_op.action.resource_id or 0))
    base_version = base_token(resource, step.observed_version or original.base_version)
    conflict = conflict_open_for_undo(
        action=undo_op.action,
        resource=resource,
        undone_operation=original,
        requested_by=f"plan {plan.pk}",
        undo_operation=undo_op,
        base_version=base_version,
        conflict_class=cls,
    )
    plan_event(
        plan,
        "plan.compensation_refused",
        step,
        undo_operation=undo_op.pk,
        reason=reason,
        conflict=str(conflict.pk),
        resolver_group=conflict.resolver_group,
        current_version=conflict.current_version,
    )


def _compensation_verdict(plan: Plan, step: PlanStep) -> str | None:
    """Settle a pending compensation from its undo operation; None while pending."""
    undo_op = Operation.objects.select_related("action").get(
        pk=int(step.compensation_operation_id or 0)
    )
    if undo_op.status == OperationStatus.PENDING:
        return None
    outcome = undo_op.outcome if isinstance(undo_op.outcome, dict) else {}
    reason = str(outcome.get("reason") or "")
    details: dict[str, Any] = {"undo_operation": undo_op.pk}
    if undo_op.status == OperationStatus.DONE or reason == ALREADY_UNDONE:
        status, event = CompensationStatus.COMPENSATED, "plan.compensation_applied"
        details["result_version"] = undo_op.result_version
    elif reason == RESOURCE_MOVED:
        conflict = _undo_conflict(undo_op)
        status, event = CompensationStatus.CONFLICT, "plan.compensation_refused"
        details.update(
            reason=reason,
            conflict=str(conflict.pk),
            resolver_group=conflict.resolver_group,
            current_version=conflict.current_version,
        )
    elif outcome.get("retryable"):
        # Transient causes exhausted the attempts: ask again (a new undo operation).
        PlanStep.objects.filter(pk=step.pk).update(compensation_status=CompensationStatus.NONE)
        step.compensation_status = CompensationStatus.NONE
        _start_compensation(plan, step)
        return None
    else:
        status, event = CompensationStatus.FAILED, "plan.compensation_refused"
        details.update(reason=reason, message=str(outcome.get("message") or ""))
    PlanStep.objects.filter(pk=step.pk).update(compensation_status=status)
    step.compensation_status = status
    plan_event(plan, event, step, **details)
    return status


def _undo_conflict(undo_op: Operation) -> Conflict:
    """The conflict of a compensation that found a later write — opened here if the
    undo job died between recording the refusal and opening it."""
    action = undo_op.action
    existing = Conflict.objects.filter(action=action, origin=ConflictOrigin.UNDO).first()
    if existing is not None:
        return existing
    return conflict_open_for_undo(
        action=action,
        resource=Resource.objects.get(pk=int(action.resource_id or 0)),
        undone_operation=Operation.objects.get(pk=int(undo_op.undo_of_id or 0)),
        requested_by=str((undo_op.outcome or {}).get("requested_by") or ""),
        undo_operation=undo_op,
    )


def _check_compensation_conflict(plan: Plan, step: PlanStep) -> str:
    """A compensation's conflict, followed through every resolution: RESOLVED once a
    person kept the current document or a write they chose applied; FAILED when a
    resolution's write failed for good; else still CONFLICT."""
    undo_op = Operation.objects.select_related("action").get(
        pk=int(step.compensation_operation_id or 0)
    )
    trail = resolution_trail(_undo_conflict(undo_op))
    if trail.state in ("open", "waiting"):
        return CompensationStatus.CONFLICT
    conflict = trail.conflict
    if trail.state == "failed":
        status, event = CompensationStatus.FAILED, "plan.compensation_refused"
        details: dict[str, Any] = {"conflict": str(conflict.pk), **(trail.error or {})}
    else:
        status, event = CompensationStatus.RESOLVED, "plan.compensation_resolved"
        details = {
            "conflict": str(conflict.pk),
            "choice": conflict.resolution,
            "resolution_action": (
                str(conflict.resolution_action_id) if conflict.resolution_action_id else None
            ),
        }
    PlanStep.objects.filter(pk=step.pk).update(compensation_status=status)
    step.compensation_status = status
    plan_event(plan, event, step, **details)
    return status
