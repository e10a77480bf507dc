"""A plan row's moves: the one UPDATE of a plan, its engine's events, and the end of
plans that never ran.

Below both `approvals.services.plans` and `approvals.services.runs` (plans imports runs),
so a run's end and a plan approval's rejection or expiry end a waiting plan by the same
rule, and the engine (plan_engine, plan_compensation) and the decisions move a plan's
ETag the same way.
"""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import F, QuerySet
from django.utils import timezone

from approvals.models import Approval, Plan, PlanStatus, PlanStep, PlanStepStatus
from approvals.notify import notify_run_changed
from audit.services import Actor, audit_append

# Who the trail names for the engine's moves.
PLAN_ENGINE = Actor.system("plan-engine")


def plan_event(plan: Plan, event_type: str, step: PlanStep | None, **details: Any) -> None:
    """An engine event about `plan` (and `step`: its position, resource and action),
    in the caller's transaction. It marks the plan changed (`revision` + 1 on the
    instance): the engine moves the row's ETag once, when it commits the move."""
    action_id = None
    if step is not None:
        action_id = step.action_id
        details = {"step": step.position, **details}
    audit_append(
        event_type=event_type,
        actor=PLAN_ENGINE,
        resource=step.resource_identifier if step is not None else "",
        run_id=plan.run_id,
        action_id=action_id,
        details={"plan": str(plan.pk), **details},
    )
    plan.revision += 1


def plan_end(plan: Plan, status: str, **details: Any) -> None:
    """The plan ends as `status` (applied, compensated, or partially compensated while a
    person decides), audited `plan.ended`."""
    Plan.objects.filter(pk=plan.pk).update(status=status, ended_at=timezone.now())
    plan.status = status
    plan_event(plan, "plan.ended", None, status=status, error=plan.error, **details)


def _touch(plans: QuerySet[Plan], *, run_id: Any, **fields: Any) -> int:
    """UPDATE `plans` with `fields` and move each one's ETag (revision); the run's
    waiters are woken after commit (a plan's long-poll listens on its run's channel)."""
    updated = plans.update(revision=F("revision") + 1, updated_at=timezone.now(), **fields)
    if updated:
        transaction.on_commit(partial(notify_run_changed, run_id))
    return updated


def plan_touch(
    *,
    plan_id: uuid.UUID,
    run_id: uuid.UUID,
    from_statuses: tuple[str, ...] | None = None,
    **fields: Any,
) -> bool:
    """One UPDATE of the plan (only from `from_statuses` when given): `fields`, and its
    ETag moved. False when the plan was not in `from_statuses`."""
    plans = Plan.objects.filter(pk=plan_id)
    if from_statuses is not None:
        plans = plans.filter(status__in=from_statuses)
    return bool(_touch(plans, run_id=run_id, **fields))


def plans_end_unapproved(
    *, run_id: Any, status: str, error: dict[str, Any], plan_id: uuid.UUID | None = None
) -> list[uuid.UUID]:
    """The run's plans still waiting for their approval (only `plan_id`, when given) end
    as `status` with `error`: nothing ran, so every step is skipped. Returns the plans
    it ended (none when they were no longer waiting).

    Caller's transaction, after the run row (the project's lock order: run, then plan);
    locks the waiting plan rows so an admission that commits first is seen, not undone.
    """
    waiting = Plan.objects.filter(run_id=run_id, status=PlanStatus.PENDING_APPROVAL)
    if plan_id is not None:
        waiting = waiting.filter(pk=plan_id)
    ended = list(waiting.select_for_update().values_list("pk", flat=True))
    if ended:
        _touch(
            Plan.objects.filter(pk__in=ended),
            run_id=run_id,
            status=status,
            error=error,
            ended_at=timezone.now(),
        )
        PlanStep.objects.filter(plan_id__in=ended).update(status=PlanStepStatus.SKIPPED)
    return ended


def plan_end_unapproved_locked(*, approval: Approval, status: str, error: dict[str, Any]) -> bool:
    """The plan's approval was rejected or expired (caller's transaction, plan row
    locked): the plan ends as `status`. False when it was no longer waiting."""
    assert approval.plan_id is not None
    ended = plans_end_unapproved(
        run_id=approval.run_id, plan_id=approval.plan_id, status=status, error=error
    )
    return bool(ended)
