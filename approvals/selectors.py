"""Read-side queries for approvals, actions and runs, filtered to what the actor may see.

Used by the API and the console pages alike; views never build permission
filters by hand. An "actor" here is a person (User), an Agent or a Run.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import Count, Exists, OuterRef, Q, QuerySet

from approvals.models import (
    Action,
    Agent,
    Approval,
    ApprovalStatus,
    Decision,
    Plan,
    PlanStep,
    Run,
    RunStatus,
)
from approvals.services.runs import run_effective_status
from console.permissions import can_decide_approvals, can_read_everything, user_groups
from engine.core.errors import NotFound
from ownership.models import Conflict, Resource


def _as_uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def approval_list_for_person(person: Any, *, status: str | None = "pending") -> QuerySet[Approval]:
    """Approvals the person may decide (operators), oldest first; escalated ones
    are also listed for members of their class's escalation group."""
    qs = Approval.objects.select_related(
        "run__agent", "action__kind", "action__conflict_class", "action__resource"
    ).annotate(approvals_so_far=Count("decisions", filter=Q(decisions__decision=Decision.APPROVE)))
    if status:
        qs = qs.filter(status=status)
    if can_decide_approvals(person):
        return qs.order_by("created_at")
    groups = user_groups(person)
    if not groups:
        return qs.none()
    # A plan's approval escalates to the groups of its steps' classes.
    plan_steps = PlanStep.objects.filter(
        plan_id=OuterRef("plan_id"), conflict_class__escalation_group__in=groups
    )
    return (
        qs.filter(escalated_at__isnull=False)
        .filter(Q(action__conflict_class__escalation_group__in=groups) | Exists(plan_steps))
        .order_by("created_at")
    )


def approval_get_for_person(person: Any, approval_id: Any) -> Approval:
    approval_uuid = _as_uuid(approval_id)
    approval = (
        approval_list_for_person(person, status=None).filter(pk=approval_uuid).first()
        if approval_uuid
        else None
    )
    if approval is None:
        raise NotFound("No such approval.")
    return approval


def _actions() -> QuerySet[Action]:
    return Action.objects.select_related("run", "agent", "kind", "conflict_class", "resource")


def _action_list_for_actor(actor: Any) -> QuerySet[Action]:
    # An Agent or a person; a run token reads through actions_visible_to.
    qs = _actions()
    if isinstance(actor, Agent):
        return actions_in_token_scope(agent_token_action_scope(actor))
    if can_read_everything(actor):
        return qs
    groups = user_groups(actor)
    if not groups:
        return qs.none()
    # Resolvers also see the refused action of a conflict assigned to their group
    # and the action their resolution created (console: live status after resolving).
    resolvable = Conflict.objects.filter(resolver_group__in=groups)
    return qs.filter(
        Q(resource__owner_group__in=groups)
        | Q(kind__owner_group__in=groups)
        | Exists(resolvable.filter(action=OuterRef("pk")))
        | Exists(resolvable.filter(resolution_action=OuterRef("pk")))
    )


def run_list_for_actor(actor: Any) -> QuerySet[Run]:
    qs = Run.objects.select_related("agent")
    if isinstance(actor, (Run, Agent)):
        return qs.filter(**token_run_scope(actor))
    if can_read_everything(actor):
        return qs
    if not getattr(actor, "pk", None):
        return qs.none()
    # Resource owners and resolvers also see the runs that wrote (or tried to write)
    # their resources: the console links a conflict or a version to its run.
    groups = user_groups(actor)
    touching = Action.objects.filter(run=OuterRef("pk")).filter(
        Q(resource__owner_group__in=groups)
        | Q(kind__owner_group__in=groups)
        | Q(conflicts__resolver_group__in=groups)
    )
    return qs.filter(Q(agent__owner=actor) | Exists(touching))


def pending_approval_count(person: Any) -> int:
    return approval_list_for_person(person, status=ApprovalStatus.PENDING).count()


def token_run_scope(reader: Run | Agent) -> dict[str, Any]:
    """What a run or agent token reads of runs (run_list_for_actor's rule for them), as the
    column values a run must have: a run token its own run, an agent token its agent's runs.
    A queryset filter here, a row check in the API's read front (approvals/api/fastpoll.py)."""
    if isinstance(reader, Run):
        return {"id": reader.pk}
    return {"agent_id": reader.pk}


# --- Who may read an action: the one rule (API and console pages) -------------------


def actions_visible_to(reader: Any) -> QuerySet[Action]:
    """The actions `reader` may read. An Agent reads its own actions; a Run's
    token reads its agent's actions while the run is pending or active, and only
    that run's once it has ended (rejected, finished, expired, revoked); a person
    reads what `_action_list_for_actor` shows them. Writes (cancel, undo) narrow
    a run token further, to its own run, in their own checks."""
    if not isinstance(reader, Run):
        return _action_list_for_actor(reader)
    return actions_in_token_scope(run_token_action_scope(reader))


def token_action_scope(reader: Any) -> dict[str, Any] | None:
    """A token reader's scope as column values (agent_token_action_scope,
    run_token_action_scope); None for a person, whose visibility is not column values."""
    if isinstance(reader, Run):
        return run_token_action_scope(reader)
    if isinstance(reader, Agent):
        return agent_token_action_scope(reader)
    return None


def actions_in_token_scope(scope: dict[str, Any]) -> QuerySet[Action]:
    """The actions a token reader may read, given its scope's column values — or `Param`s,
    for a statement compiled once per scope's shape (approvals/api/actions.py)."""
    return _actions().filter(**scope)


def agent_token_action_scope(agent: Agent) -> dict[str, Any]:
    """What an agent token reads (actions_visible_to's rule for an Agent), as the column
    values an action must have: its own actions. A queryset filter here, a row check in the
    API's read front (approvals/api/fastpoll.py): one rule."""
    return {"agent_id": agent.pk}


def run_token_action_scope(run: Run) -> dict[str, Any]:
    """What a run token reads (actions_visible_to's rule for a Run), as the column values
    an action must have: its agent's actions while the run is pending or active, only the
    run's own once it has ended. A queryset filter here, a row check in the poll's fast
    path (approvals/api/fastpoll.py): one rule."""
    if run_effective_status(run) in (RunStatus.PENDING_APPROVAL, RunStatus.ACTIVE):
        return {"agent_id": run.agent_id}
    return {"agent_id": run.agent_id, "run_id": run.pk}


# --- Plans -------------------------------------------------------------------------


def plans_visible_to(reader: Any) -> QuerySet[Plan]:
    """The plans `reader` may read: an agent its own; a run token its agent's while the
    run is pending or active, only its run's once ended (as for actions); a person the
    plans of the runs they may read."""
    qs = Plan.objects.select_related("run", "agent")
    if isinstance(reader, Run):
        if run_effective_status(reader) in (RunStatus.PENDING_APPROVAL, RunStatus.ACTIVE):
            return qs.filter(agent_id=reader.agent_id)
        return qs.filter(run=reader)
    if isinstance(reader, Agent):
        return qs.filter(agent=reader)
    if can_read_everything(reader):
        return qs
    # A resource's owners see a plan that will write it before any step has run (they
    # may be asked to resolve its conflicts), as well as the plans of the runs they see.
    groups = user_groups(reader)
    touching = PlanStep.objects.filter(plan=OuterRef("pk")).filter(
        Q(kind__owner_group__in=groups)
        | Exists(
            Resource.objects.filter(
                kind_id=OuterRef("kind_id"), name=OuterRef("name"), owner_group__in=groups
            )
        )
    )
    return qs.filter(Q(run__in=run_list_for_actor(reader)) | Exists(touching))


def plan_step_resources(steps: list[PlanStep]) -> dict[tuple[str, str], Resource]:
    """The resources a plan's steps write, as they are now, by (kind, name), in one query
    (a create's resource is absent until it applied)."""
    wanted = Q(pk__in=[])
    for step in steps:
        wanted |= Q(kind_id=step.kind_id, name=step.name)
    return {(r.kind_id, r.name): r for r in Resource.objects.filter(wanted)} if steps else {}


def plan_detail(plan: Plan) -> dict[str, Any]:
    """What a plan's page and JSON show beside the plan row: its steps (with the
    resource's current version for the diff) and its approval, votes included."""
    steps = list(
        PlanStep.objects.filter(plan=plan)
        .select_related("kind", "conflict_class", "applied_operation", "compensation_operation")
        .order_by("position")
    )
    action_ids = [s.action_id for s in steps if s.action_id] + [
        s.applied_operation.action_id for s in steps if s.applied_operation
    ]
    conflicts = {
        (c.action_id, c.origin): c for c in Conflict.objects.filter(action_id__in=action_ids)
    }
    approval = (
        Approval.objects.filter(plan=plan)
        .prefetch_related("decisions__person")
        .order_by("-created_at")
        .first()
    )
    return {"steps": steps, "conflicts": conflicts, "approval": approval}
