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
- compensation, last applied step first and in strict reverse order
  (approvals/services/plan_compensation.py): each its own undo operation of the
  write that applied the step (`Operation.compensation`: no undo window), restoring
  the version before it or the agent's explicit compensation (`Operation.restore`),
  the undo core's conditional write against the version the step produced. If
  someone wrote since, or no one approved its effect (the step applied through a
  person's resolution; its own class is per-call and the plan had no approval), it
  becomes a conflict for a person instead of writing, and the plan is
  `partially_compensated` — the earlier steps waiting — until a person settles it.
- settled late: a step whose write ended `failed` with its outcome unknown refuses
  the plan like any failure; should the periodic re-read (approvals/services/reread.py)
  later find that write took effect, its action is `applied` and the step's effect is
  on the target. A plan that stopped (compensating, partially compensated, or
  compensated: reopened to compensating) records the step `applied`, `settled_late`
  on its error, audits `plan.step_settled_late`, and compensates it in its place in
  reverse order: it is the latest applied step, so its compensation starts next (the
  earlier steps' compensations already done or under way are not redone). A plan still
  going forward never refused the step: it reads the action `applied` as any step's and
  goes on (nothing was compensated).

Jobs (approvals/jobs.py) call `plan_advance` and `plan_after_action`; the reconciler
calls `plans_resume` so a worker killed between steps or a Redis FLUSHALL never
strands a plan.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    CompensationStatus,
    Operation,
    Plan,
    PlanStatus,
    PlanStep,
    PlanStepStatus,
)
from approvals.outbox import enqueue_action_execution
from approvals.services.actions import WRITE_COLUMNS
from approvals.services.attempts import crash_point
from approvals.services.plan_compensation import (
    MAX_RESOLUTION_CHAIN,
    plan_compensate,
    resolution_trail,
)
from approvals.services.plan_state import plan_end, plan_event, plan_touch
from console.compiled_query import CompiledQuery, Param
from engine.core.operations import applied_operation
from ownership.models import Conflict, ConflictOrigin, Resource

log = logging.getLogger("airlock.plans")

# Plans the reconciler reads per query (it goes through every page in one pass).
RESUME_PAGE = 200
_MOVING = (PlanStatus.EXECUTING, PlanStatus.COMPENSATING, PlanStatus.PARTIALLY_COMPENSATED)
# Plans that stopped going forward: a refused step's write settled late joins their
# compensation.
_STOPPED = (PlanStatus.COMPENSATING, PlanStatus.PARTIALLY_COMPENSATED, PlanStatus.COMPENSATED)


def plan_advance(*, plan_id: uuid.UUID | str) -> str:
    """Move the plan as far as its steps allow, in one transaction; a short outcome."""
    return _advance(plan_id)[0]


def _advance(plan_id: uuid.UUID | str) -> tuple[str, bool]:
    """(outcome, whether the plan changed). Every change is audited (`plan_event`), which
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
        if plan.status in _STOPPED:
            _steps_settled_late(plan, steps)
        if plan.status == PlanStatus.EXECUTING:
            outcome = _forward(plan, steps)
        elif plan.status in (PlanStatus.COMPENSATING, PlanStatus.PARTIALLY_COMPENSATED):
            outcome = plan_compensate(plan, steps)
        else:
            return f"skipped:{plan.status}", False
        moved = plan.revision != seen
        if moved:
            plan_touch(plan_id=plan.pk, run_id=plan.run_id)
        crash_point("plan_advance_before_commit")
        return outcome, moved


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
        return plan_compensate(plan, steps)
    plan_end(plan, PlanStatus.APPLIED)
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
    plan_event(plan, "plan.step_started", step, observed_version=step.observed_version)
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
    """A stale step: the agent's to retry (the plan stops), or a person's to resolve —
    followed through every resolution (one whose write was itself refused as stale is
    a new conflict) until one is final."""
    conflict = Conflict.objects.filter(action=action, origin=ConflictOrigin.WRITE).first()
    stale = {"code": "stale_version", "conflict": str(conflict.pk) if conflict else None}
    if conflict is None or action.conflict_class.retryable_by_agent:
        return {**stale, "routed_to": "agent"}
    trail = resolution_trail(conflict)
    if trail.state == "open":
        waiting_on = trail.conflict
        if not isinstance(step.error, dict) or step.error.get("conflict") != str(waiting_on.pk):
            waiting = {
                **stale,
                "conflict": str(waiting_on.pk),
                "routed_to": waiting_on.resolver_group or waiting_on.resolver,
            }
            PlanStep.objects.filter(pk=step.pk).update(error=waiting)
            plan_event(plan, "plan.step_waiting", step, **waiting)
        return None
    if trail.state == "applied":
        return trail.operation
    if trail.state == "kept":
        return {
            **stale,
            "conflict": str(trail.conflict.pk),
            "routed_to": "person",
            "resolution": trail.conflict.resolution,
        }
    if trail.state == "failed":
        return {**stale, "conflict": str(trail.conflict.pk), **(trail.error or {})}
    return None  # a resolution's write on its way; a rejected one reopens its conflict


def _step_applied(plan: Plan, step: PlanStep, operation: Operation) -> None:
    PlanStep.objects.filter(pk=step.pk).update(
        status=PlanStepStatus.APPLIED, applied_operation=operation
    )
    step.status, step.applied_operation = PlanStepStatus.APPLIED, operation
    plan_event(
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
    plan_event(plan, "plan.step_refused", step, **error)


# --- settled late ------------------------------------------------------------------


def _steps_settled_late(plan: Plan, steps: list[PlanStep]) -> None:
    """A refused step whose action is now `applied` (the re-read found its write took
    effect after the plan stopped): the step is applied, by the operation the re-read
    settled, and compensates like the others — a compensated plan compensates again."""
    for step in steps:
        action = step.action
        if step.status != PlanStepStatus.REFUSED or action is None:
            continue
        if action.status != ActionStatus.APPLIED:
            continue
        operation = applied_operation(action.pk)
        if operation is None:
            continue
        refused = step.error if isinstance(step.error, dict) else {}
        late = {
            "operation": operation.pk,
            "result_version": operation.result_version,
            "at": (operation.finished_at or timezone.now()).isoformat(),
        }
        error = {**refused, "settled_late": late}
        PlanStep.objects.filter(pk=step.pk).update(
            status=PlanStepStatus.APPLIED,
            applied_operation=operation,
            compensation_status=CompensationStatus.NONE,
            error=error,
        )
        step.status, step.applied_operation, step.error = PlanStepStatus.APPLIED, operation, error
        step.compensation_status = CompensationStatus.NONE
        reopened = plan.status == PlanStatus.COMPENSATED
        if reopened:
            Plan.objects.filter(pk=plan.pk).update(status=PlanStatus.COMPENSATING, ended_at=None)
        plan_event(
            plan,
            "plan.step_settled_late",
            step,
            operation=operation.pk,
            by_action=str(action.pk),
            base_version=operation.base_version,
            result_version=operation.result_version,
            refused=refused,
            plan_was=plan.status,
        )
        if reopened:
            plan.status = PlanStatus.COMPENSATING


def plans_settled_late(*, since: datetime) -> int:
    """The re-read's pass (after it records writes settled late): every plan that stopped
    (last changed after `since`) with a refused step whose action is now `applied`
    compensates it — a compensated one reopened. (The reconciler's plans_resume moves the
    ones still compensating the same way; a compensated plan only this pass reopens.)
    Idempotent; returns how many plans moved."""
    late = (
        Plan.objects.filter(
            status__in=_STOPPED,
            updated_at__gte=since,
            steps__status=PlanStepStatus.REFUSED,
            steps__action__status=ActionStatus.APPLIED,
        )
        .values_list("pk", flat=True)
        .distinct()
    )
    moved = 0
    for plan_id in list(late):
        try:
            moved += int(_advance(plan_id)[1])
        except Exception:  # one stuck plan must not stop the others
            log.exception("could not reopen plan %s", plan_id)
    return moved


# --- who moves a plan ------------------------------------------------------------


# A write's parent and plan (asked of every write the worker applies: is it a plan's?).
_PARENT_AND_PLAN = CompiledQuery(
    lambda: Action.objects.filter(pk=Param("id", Action._meta.get_field("id"))).values_list(
        "parent_id", "plan_step__plan_id"
    )
)


def _plan_of_action(action_id: uuid.UUID | str) -> uuid.UUID | None:
    """The plan a write belongs to: as a step's action, or as a conflict resolution
    (of a step, or of a step's compensation) further down its `parent` chain."""
    current: Any = action_id
    for _ in range(MAX_RESOLUTION_CHAIN + 2):
        row = _PARENT_AND_PLAN.first(id=current)
        if row is None:
            return None
        parent_id, plan_id = row
        if plan_id is not None:
            return uuid.UUID(str(plan_id))
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
    between steps, a job Redis lost), however many wait for people: all of them, in
    pages of `RESUME_PAGE` by (updated_at, id) — a keyset, so plans parked on a
    person's decision never fill a window that hides the rest. Idempotent; returns
    how many moved."""
    moved = 0
    after: tuple[Any, Any] | None = None
    while True:
        page = Plan.objects.filter(status__in=_MOVING)
        if after is not None:
            page = page.filter(Q(updated_at__gt=after[0]) | Q(updated_at=after[0], pk__gt=after[1]))
        rows = list(page.order_by("updated_at", "pk").values_list("updated_at", "pk")[:RESUME_PAGE])
        for _, plan_id in rows:
            try:
                moved += int(_advance(plan_id)[1])
            except Exception:  # one stuck plan must not stop the others
                log.exception("could not advance plan %s", plan_id)
        if len(rows) < RESUME_PAGE:
            return moved
        after = rows[-1]
