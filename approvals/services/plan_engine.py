"""A plan's state machine: steps applied in order, compensations in reverse.

`plan_advance` is the one move; it is idempotent and runs under the plan row lock,
so any number of deliveries (the plan's job, the job of a step's write, the
reconciler) move a plan exactly once per state. PostgreSQL is the outbox: a step's
state says what comes next, and every write goes through the ordinary engine —

- forward: a step's action is created only when its turn comes (nothing can run it
  early), queued and executed through the fenced lock and the write barrier, which
  re-validates its precondition. Applied → the next step. Refused as stale → its
  class decides: retryable by the agent → the plan stops and compensates (the agent
  reads why on the plan); a person's → a conflict whose resolution (its own write,
  applied) lets the plan go on, while keeping the current document stops it.
  A kill switch pauses the step's action; the release resumes it and the plan.
- compensation, last applied step first: an undo operation of the write that
  applied the step (`Operation.compensation`: no undo window), restoring the
  version before it or the agent's explicit compensation (`Operation.restore`).
  It is the undo core's conditional write against the version the step produced:
  if someone wrote since, it becomes a conflict for the class's resolver instead of
  overwriting their change, and the plan ends `partially_compensated` until a person
  settles it; settling the last one ends it `compensated`.

Jobs (approvals/jobs.py) call `plan_advance` and `plan_after_action`; the reconciler
calls `plans_resume` so a worker killed between steps or a Redis FLUSHALL never
strands a plan.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from django.db import transaction
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    CompensationStatus,
    Operation,
    OperationStatus,
    Plan,
    PlanStatus,
    PlanStep,
    PlanStepStatus,
)
from approvals.outbox import enqueue_action_execution, enqueue_undo_execution
from approvals.services.actions import WRITE_COLUMNS
from approvals.services.attempts import crash_point
from approvals.services.plan_state import plan_touch
from audit.services import Actor, audit_append
from console.core.fence import next_fence
from console.core.operations import applied_operation, open_operation
from console.core.undo import ALREADY_UNDONE, RESOURCE_MOVED
from ownership.diff import apply_merge_patch
from ownership.models import Conflict, ConflictOrigin, ConflictStatus, Resource, ResourceVersion
from ownership.services.conflicts import conflict_open_for_undo

log = logging.getLogger("airlock.plans")

ENGINE = Actor.system("plan-engine")
# Plans the reconciler looks at in one pass (oldest change first).
RESUME_BATCH = 200
_MOVING = (PlanStatus.EXECUTING, PlanStatus.COMPENSATING, PlanStatus.PARTIALLY_COMPENSATED)


def plan_advance(*, plan_id: uuid.UUID | str) -> str:
    """Move the plan as far as its steps allow, in one transaction; a short outcome."""
    return _advance(plan_id)[0]


def _advance(plan_id: uuid.UUID | str) -> tuple[str, bool]:
    """(outcome, whether the plan changed). Every change is audited (`_audit`), which
    marks the plan; a changed plan's ETag moves once, at the end."""
    with transaction.atomic():
        plan = Plan.objects.select_for_update(of=("self",)).filter(pk=plan_id).first()
        if plan is None:
            return "missing", False
        steps = list(
            PlanStep.objects.filter(plan=plan)
            .select_related("action", "kind", "conflict_class", "applied_operation")
            .order_by("position")
        )
        seen = plan.revision
        if plan.status == PlanStatus.EXECUTING:
            outcome = _forward(plan, steps)
        elif plan.status in (PlanStatus.COMPENSATING, PlanStatus.PARTIALLY_COMPENSATED):
            outcome = _compensate(plan, steps)
        else:
            return f"skipped:{plan.status}", False
        moved = plan.revision != seen
        if moved:
            plan_touch(plan_id=plan.pk, run_id=plan.run_id)
        crash_point("plan_advance_before_commit")
        return outcome, moved


def _audit(plan: Plan, event_type: str, step: PlanStep | None, **details: Any) -> None:
    """A plan event: names the plan and, for a step, its position, resource and action."""
    action_id = None
    if step is not None:
        action_id = step.action_id
        details = {"step": step.position, **details}
    audit_append(
        event_type=event_type,
        actor=ENGINE,
        resource=step.resource_identifier if step is not None else "",
        run_id=plan.run_id,
        action_id=action_id,
        details={"plan": str(plan.pk), **details},
    )
    plan.revision += 1  # marks the plan changed: _advance moves its ETag once, at the end


# --- forward -----------------------------------------------------------------


def _forward(plan: Plan, steps: list[PlanStep]) -> str:
    for step in steps:
        if step.status == PlanStepStatus.APPLIED:
            continue
        if step.status == PlanStepStatus.PENDING:
            _start_step(plan, step)
            return f"started:{step.position}"
        verdict = _step_verdict(plan, step)
        if verdict is None:
            return f"waiting:{step.position}"
        if isinstance(verdict, Operation):
            _step_applied(plan, step, verdict)
            continue
        _step_refused(plan, steps, step, verdict)
        return _compensate(plan, steps)
    _end(plan, PlanStatus.APPLIED)
    return "applied"


def _start_step(plan: Plan, step: PlanStep) -> None:
    """The step's write, queued now that every step before it applied."""
    resource = Resource.objects.filter(kind_id=step.kind_id, name=step.name).first()
    action = Action.objects.create(
        # The step's write exactly as the plan recorded (and checked) it.
        **{column: getattr(step, column) for column in WRITE_COLUMNS},
        run_id=plan.run_id,
        agent_id=plan.agent_id,
        resource=resource,
        status=ActionStatus.QUEUED,
        reason=f"plan {plan.pk} step {step.position}: {plan.reason}"[:500],
        request_id=f"plan-{plan.pk}"[:128],
    )
    PlanStep.objects.filter(pk=step.pk).update(status=PlanStepStatus.EXECUTING, action=action)
    step.action, step.status = action, PlanStepStatus.EXECUTING
    _audit(plan, "plan.step_started", step, observed_version=step.observed_version)
    transaction.on_commit(lambda: enqueue_action_execution(action.pk))


def _step_verdict(plan: Plan, step: PlanStep) -> Operation | dict[str, Any] | None:
    """The operation that applied the step, the error that refused it for good, or
    None while it is still on its way (queued, paused, or a conflict a person decides)."""
    action = step.action
    assert action is not None
    if action.status == ActionStatus.APPLIED:
        return applied_operation(action.pk)
    if action.status == ActionStatus.CONFLICT:
        return _conflict_verdict(plan, step, action)
    if action.status == ActionStatus.UNDONE:
        return {"code": "undone", "message": "the step's write was undone before the plan ended"}
    if action.is_final:
        error = action.error if isinstance(action.error, dict) else {}
        return {"code": str(error.get("code") or action.status), "action_status": action.status}
    return None


def _conflict_verdict(
    plan: Plan, step: PlanStep, action: Action
) -> Operation | dict[str, Any] | None:
    """A stale step: the agent's to retry (the plan stops), or a person's to resolve."""
    conflict = Conflict.objects.filter(action=action, origin=ConflictOrigin.WRITE).first()
    stale = {"code": "stale_version", "conflict": str(conflict.pk) if conflict else None}
    if conflict is None or action.conflict_class.retryable_by_agent:
        return {**stale, "routed_to": "agent"}
    if conflict.status == ConflictStatus.OPEN:
        if not isinstance(step.error, dict) or step.error.get("conflict") != str(conflict.pk):
            waiting = {**stale, "routed_to": conflict.resolver_group or conflict.resolver}
            PlanStep.objects.filter(pk=step.pk).update(error=waiting)
            _audit(plan, "plan.step_waiting", step, **waiting)
        return None
    if conflict.resolution_action_id is None:
        return {**stale, "routed_to": "person", "resolution": conflict.resolution}
    resolution = Action.objects.get(pk=conflict.resolution_action_id)
    if resolution.status == ActionStatus.APPLIED:
        return applied_operation(resolution.pk)
    return None  # on its way; a rejected one reopens the conflict


def _step_applied(plan: Plan, step: PlanStep, operation: Operation) -> None:
    PlanStep.objects.filter(pk=step.pk).update(
        status=PlanStepStatus.APPLIED, applied_operation=operation
    )
    step.status, step.applied_operation = PlanStepStatus.APPLIED, operation
    _audit(
        plan,
        "plan.step_applied",
        step,
        operation=operation.pk,
        by_action=str(operation.action_id),
        fence=operation.fence,
        base_version=operation.base_version,
        result_version=operation.result_version,
    )


def _step_refused(plan: Plan, steps: list[PlanStep], step: PlanStep, error: dict[str, Any]) -> None:
    """The step failed for good: the rest never run, the applied ones are compensated."""
    PlanStep.objects.filter(pk=step.pk).update(status=PlanStepStatus.REFUSED, error=error)
    step.status, step.error = PlanStepStatus.REFUSED, error
    later = [s for s in steps if s.position > step.position]
    PlanStep.objects.filter(pk__in=[s.pk for s in later]).update(status=PlanStepStatus.SKIPPED)
    for skipped in later:
        skipped.status = PlanStepStatus.SKIPPED
    plan_error = {"step": step.position, "resource": step.resource_identifier, **error}
    Plan.objects.filter(pk=plan.pk).update(status=PlanStatus.COMPENSATING, error=plan_error)
    plan.status, plan.error = PlanStatus.COMPENSATING, plan_error
    _audit(plan, "plan.step_refused", step, **error)


# --- compensation --------------------------------------------------------------


def _compensate(plan: Plan, steps: list[PlanStep]) -> str:
    applied = [s for s in reversed(steps) if s.status == PlanStepStatus.APPLIED]
    for step in applied:
        status = step.compensation_status
        if status == CompensationStatus.NONE:
            _start_compensation(plan, step)
            return f"compensating:{step.position}"
        if status == CompensationStatus.PENDING:
            settled = _compensation_verdict(plan, step)
            if settled is None:
                return f"compensating:{step.position}"
            status = settled
        if status == CompensationStatus.CONFLICT:
            _check_compensation_conflict(plan, step)
    blocked = [
        s.position
        for s in applied
        if s.compensation_status in (CompensationStatus.CONFLICT, CompensationStatus.FAILED)
    ]
    if blocked:
        if plan.status != PlanStatus.PARTIALLY_COMPENSATED:
            _end(plan, PlanStatus.PARTIALLY_COMPENSATED, blocked_steps=blocked)
        return "partially_compensated"
    _end(plan, PlanStatus.COMPENSATED)
    return "compensated"


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
    produced = ResourceVersion.objects.filter(
        resource__kind_id=step.kind_id,
        resource__name=step.name,
        version=int(operation.result_version or 0),
    ).first()
    base = produced.document if produced is not None and not produced.deleted else {}
    return {"document": apply_merge_patch(base, compensation.get("patch") or {}), "deleted": False}


def _start_compensation(plan: Plan, step: PlanStep) -> None:
    """An undo operation of the write that applied the step, queued after commit (or
    the live undo someone already asked for, which then is the compensation)."""
    original = step.applied_operation
    assert original is not None
    live = (
        Operation.objects.filter(undo_of=original)
        .exclude(status=OperationStatus.FAILED)
        .order_by("-started_at")
        .first()
    )
    undo_op = live or open_operation(
        action_id=original.action_id,
        fence=next_fence(),
        worker="plan-compensation",
        lease_seconds=0,
        undo_of_id=original.pk,
    )
    if live is None:
        Operation.objects.filter(pk=undo_op.pk).update(
            lease_expires_at=None,
            accepted_at=timezone.now(),
            compensation=True,
            restore=_restore_for(step, original),
            outcome={"requested_by": f"plan {plan.pk}", "requested_by_type": "system"},
        )
    PlanStep.objects.filter(pk=step.pk).update(
        compensation_status=CompensationStatus.PENDING, compensation_operation=undo_op
    )
    step.compensation_status = CompensationStatus.PENDING
    _audit(
        plan,
        "plan.compensation_started",
        step,
        operation=original.pk,
        undo_operation=undo_op.pk,
        compensation=(step.compensation or {}).get("method", "undo"),
        expected_version=original.result_version,
    )
    undo_id = undo_op.pk
    transaction.on_commit(lambda: enqueue_undo_execution(undo_id))


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
    _audit(plan, event, step, **details)
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


def _check_compensation_conflict(plan: Plan, step: PlanStep) -> None:
    """A person settled the compensation's conflict: resolved once any write it chose
    has applied (a rejected resolution reopens the conflict, so it stays blocked)."""
    undo_op = Operation.objects.select_related("action").get(
        pk=int(step.compensation_operation_id or 0)
    )
    conflict = _undo_conflict(undo_op)
    if conflict.status != ConflictStatus.RESOLVED:
        return
    if conflict.resolution_action_id is not None:
        status = (
            Action.objects.filter(pk=conflict.resolution_action_id)
            .values_list("status", flat=True)
            .get()
        )
        if status != ActionStatus.APPLIED:
            return
    PlanStep.objects.filter(pk=step.pk).update(compensation_status=CompensationStatus.RESOLVED)
    step.compensation_status = CompensationStatus.RESOLVED
    _audit(
        plan,
        "plan.compensation_resolved",
        step,
        conflict=str(conflict.pk),
        choice=conflict.resolution,
        resolution_action=(
            str(conflict.resolution_action_id) if conflict.resolution_action_id else None
        ),
    )


def _end(plan: Plan, status: str, **details: Any) -> None:
    Plan.objects.filter(pk=plan.pk).update(status=status, ended_at=timezone.now())
    plan.status = status
    _audit(plan, "plan.ended", None, status=status, error=plan.error, **details)


# --- who moves a plan ------------------------------------------------------------


def _plan_of_action(action_id: uuid.UUID | str) -> uuid.UUID | None:
    """The plan a write belongs to: as a step's action, or as a conflict resolution
    (of a step, or of a step's compensation) further down its `parent` chain."""
    current: Any = action_id
    for _ in range(4):
        row = (
            Action.objects.filter(pk=current).values_list("parent_id", "plan_step__plan_id").first()
        )
        if row is None:
            return None
        parent_id, plan_id = row
        if plan_id is not None:
            return plan_id
        if parent_id is None:
            return None
        current = parent_id
    return None


def plan_after_action(*, action_id: uuid.UUID | str) -> str:
    """A write (or an undo of one) finished a delivery: move its plan, if any."""
    plan_id = _plan_of_action(action_id)
    if plan_id is None:
        return "no_plan"
    return plan_advance(plan_id=plan_id)


def plans_resume() -> int:
    """The reconciler's pass: advance every plan still moving (a worker killed
    between steps, a job Redis lost). Idempotent; returns how many moved."""
    moved = 0
    ids = list(
        Plan.objects.filter(status__in=_MOVING)
        .order_by("updated_at")
        .values_list("pk", flat=True)[:RESUME_BATCH]
    )
    for plan_id in ids:
        try:
            moved += int(_advance(plan_id)[1])
        except Exception:  # one stuck plan must not stop the others
            log.exception("could not advance plan %s", plan_id)
    return moved
