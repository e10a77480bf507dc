"""Plans: one change across several resources, proposed whole, approved as one.

A run proposes an ordered list of conditional writes (each exactly like a single
write, on Airlock's own store or on an external target: resource, method, document or
patch, If-Match / If-None-Match, its conflict class) and, for each, its compensation:
the undo of that step (default) or an explicit conditional write. Everything is
checked and recorded in one transaction before anything executes; a refusal (outside
the write set, a duplicate resource, more than `AIRLOCK_PLAN_MAX_STEPS` steps, a stale
tag) records nothing.

An explicit compensation is a write like any other and is checked as the write it
is (docs/plans-compensation.md): the run's write set must cover its operation (a
DELETE compensation needs `delete` on that resource), and its conflict class — the
kind's class for that operation — counts with the steps' classes. A plan whose steps
and explicit compensations are all per-run classes runs at once (the run's approval
covers them); one per-call class among them makes the whole plan wait for one
approval whose quorum, separation of duties and TTL are the strictest among them,
and whose approvers see every step's and every compensation's document as a diff
against the version observed (`plan_step_previews`).
Execution, compensation and crash recovery are approvals/services/plan_engine.py.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from approvals.models import (
    Approval,
    ApprovalSubject,
    Plan,
    PlanStatus,
    PlanStep,
    Run,
)
from approvals.outbox import enqueue_plan_advance
from approvals.services.actions import (
    Proposal,
    authority_check_locked,
    precondition_check,
    superseded_by_queued,
)
from approvals.services.approval_open import approval_details
from approvals.services.plan_state import plan_touch
from approvals.services.preconditions import PreconditionRequired
from approvals.services.queued_writes import lock_resource_for_proposal, writes_in_flight
from approvals.services.runs import run_status_for_share
from approvals.services.write_sets import lock_kinds
from audit.services import Actor, audit_append, audit_deferred
from engine.core.errors import DomainError, ValidationFailed
from ownership.diff import apply_merge_patch, document_diff, proposed_document
from ownership.history import revision_at
from ownership.models import ApprovalMode, ConflictClass, Resource
from ownership.targets import is_external, refresh_mirror

COMPENSATION_METHODS = ("PUT", "PATCH", "DELETE")


@dataclass(frozen=True)
class PlanStepSpec:
    """One step as the agent sent it: the write, and its compensation (None: undo)."""

    proposal: Proposal
    compensation: dict[str, Any] | None = None


def max_plan_steps() -> int:
    return int(settings.AIRLOCK_PLAN_MAX_STEPS)


def _step_error(position: int, field: str, message: str) -> ValidationFailed:
    return ValidationFailed(
        f"step {position}: {message}",
        extra={"errors": [{"field": f"steps[{position - 1}].{field}", "message": message}]},
    )


def compensation_operation(step_operation: str, method: str) -> str:
    """The write an explicit compensation is, against what the step leaves behind:
    DELETE deletes; a PUT after a step that deleted creates the resource again;
    any other PUT or PATCH updates."""
    if method == "DELETE":
        return "delete"
    return "create" if step_operation == "delete" and method == "PUT" else "update"


def _check_compensation(position: int, spec: PlanStepSpec) -> None:
    """An explicit compensation is a method with what it needs (PUT: a document,
    PATCH: a merge patch, DELETE: nothing) that can apply to what the step leaves
    (after a delete, only a PUT); a created resource's is the delete (its undo)
    unless given."""
    compensation = spec.compensation
    if compensation is None:
        return
    method = compensation.get("method")
    if method not in COMPENSATION_METHODS:
        raise _step_error(position, "compensation.method", "must be PUT, PATCH or DELETE")
    if spec.proposal.operation == "delete" and method != "PUT":
        raise _step_error(
            position,
            "compensation.method",
            f"the step deletes the resource: {method} has nothing to apply to (use PUT, or "
            "leave the compensation out to undo the delete)",
        )
    needs = {"PUT": "document", "PATCH": "patch"}.get(str(method))
    for key in compensation:
        if key not in ("method", "document", "patch"):
            raise _step_error(position, f"compensation.{key}", "unknown field")
    if needs is not None and not isinstance(compensation.get(needs), dict):
        raise _step_error(position, f"compensation.{needs}", f"{method} needs a JSON object")
    extra = {"document", "patch"} - ({needs} if needs else set())
    if any(key in compensation for key in extra):
        raise _step_error(position, "compensation", f"{method} takes only {needs or 'no body'}")


def plan_steps_shape_check(steps: Sequence[PlanStepSpec]) -> None:
    """Count, duplicates, preconditions and compensations: 422 / 428, before any lock."""
    if not steps:
        raise ValidationFailed(
            "A plan needs at least one step.",
            extra={"errors": [{"field": "steps", "message": "at least one step"}]},
        )
    limit = max_plan_steps()
    if len(steps) > limit:
        raise ValidationFailed(
            f"A plan has at most {limit} steps; this one has {len(steps)}.",
            extra={"errors": [{"field": "steps", "message": f"at most {limit} steps"}]},
        )
    seen: dict[str, int] = {}
    for position, spec in enumerate(steps, start=1):
        proposal = spec.proposal
        identifier = proposal.resource_identifier
        if identifier in seen:
            raise _step_error(
                position,
                "resource",
                f"{identifier} is already step {seen[identifier]}; a plan writes each "
                "resource once",
            )
        seen[identifier] = position
        if proposal.operation == "create" and not proposal.create_if_absent:
            raise PreconditionRequired(
                f"step {position}: creating needs if_none_match '*'.",
                extra={"resource": identifier, "step": position},
            )
        if proposal.operation != "create" and proposal.if_match is None:
            raise PreconditionRequired(
                f"step {position}: writes need if_match with the ETag you read.",
                extra={"resource": identifier, "step": position},
            )
        _check_compensation(position, spec)


def plan_mirrors_refresh(steps: Sequence[PlanStepSpec]) -> None:
    """Each external step's mirror holds the version the agent names (read from the target
    unless it already does), so the step's tag, the approver's diff and its compensation's
    document are the target's — before any lock: a target's answer is never waited for
    inside the proposal's transaction. The target's conditional write at execution stays
    the last word."""
    for position, spec in enumerate(steps, start=1):
        proposal = spec.proposal
        if not is_external(proposal.kind):
            continue
        tag = None if proposal.if_match is None else str(proposal.if_match.tags[0])
        try:
            refresh_mirror(proposal.kind, proposal.name, tag)
        except DomainError as error:
            error.extra = {**(error.extra or {}), "step": position}
            raise


def _lock_and_check_authority(run: Run, steps: Sequence[PlanStepSpec]) -> None:
    """plan_steps_lock, then each step's write set and lease check."""
    plan_steps_authority_check(run, plan_steps_lock(run, steps), steps)


def plan_steps_lock(run: Run, steps: Sequence[PlanStepSpec]) -> str:
    """The single write's locks in the one lock order, for every step at once: the
    kinds (shared), the resources (sorted), then the run FOR SHARE (its status returned)."""
    proposals = [spec.proposal for spec in steps]
    lock_kinds({p.kind.slug for p in proposals}, shared=True)
    for kind, name in sorted({(p.kind.slug, p.name) for p in proposals}):
        lock_resource_for_proposal(kind, name)
    return run_status_for_share(run.pk)


def plan_steps_authority_check(run: Run, status: str, steps: Sequence[PlanStepSpec]) -> None:
    """Each step's (and explicit compensation's) write set and lease check, the locks of
    plan_steps_lock held; a refusal names its `step`."""
    for position, spec in enumerate(steps, start=1):
        proposal = spec.proposal
        writes = [("", proposal.operation)]
        if spec.compensation is not None:
            method = str(spec.compensation["method"])
            writes.append(("compensation", compensation_operation(proposal.operation, method)))
        for field, operation in writes:
            try:
                authority_check_locked(
                    run=run,
                    status=status,
                    kind=proposal.kind.slug,
                    name=proposal.name,
                    operation=operation,
                )
            except DomainError as error:
                where = {"step": position, **({"field": field} if field else {})}
                error.extra = {**(error.extra or {}), **where}
                if field:
                    error.message = f"step {position}, its compensation: {error.message}"
                raise


def plan_observed_versions(steps: Sequence[PlanStepSpec]) -> list[str | None] | DomainError:
    """Each step's observed version, or the 412 of the first stale step (`step` named)."""
    observed: list[str | None] = []
    for position, spec in enumerate(steps, start=1):
        proposal = spec.proposal
        conflict_class = proposal.kind.class_for(proposal.operation)
        in_flight = writes_in_flight(proposal.kind.slug, proposal.name)
        resource = Resource.objects.filter(kind=proposal.kind, name=proposal.name).first()
        version, refused = precondition_check(proposal, resource, conflict_class)
        if refused is None:
            refused = superseded_by_queued(proposal, version, in_flight, conflict_class)
        if refused is not None:
            refused.extra = {**(refused.extra or {}), "step": position}
            return refused
        observed.append(version)
    return observed


def plan_strictest_terms(classes: Sequence[ConflictClass]) -> dict[str, Any]:
    """What the plan's approval asks: the highest quorum, the shortest TTL and
    escalation, separation of duties if any class asks for it."""
    escalations = [c.escalation_seconds for c in classes if c.escalation_seconds]
    return {
        "quorum": max(c.quorum for c in classes),
        "ttl_seconds": min(c.approval_ttl_seconds for c in classes),
        "escalation_seconds": min(escalations) if escalations else 0,
        "forbid_agent_owner_approval": any(c.forbid_agent_owner_approval for c in classes),
    }


def _plan_classes(plan: Plan) -> list[ConflictClass]:
    """The distinct conflict classes of a plan's steps and of their explicit
    compensations (as recorded at proposal), by slug."""
    classes: dict[str, ConflictClass] = {}
    compensation_slugs: set[str] = set()
    for step in plan.steps.select_related("conflict_class"):
        classes[step.conflict_class.slug] = step.conflict_class
        slug = (step.compensation or {}).get("conflict_class")
        if slug and slug not in classes:
            compensation_slugs.add(str(slug))
    for cls in ConflictClass.objects.filter(slug__in=compensation_slugs - set(classes)):
        classes[cls.slug] = cls
    return [classes[slug] for slug in sorted(classes)]


def _recorded_compensation(
    spec: PlanStepSpec,
) -> tuple[dict[str, Any] | None, ConflictClass | None]:
    """The compensation as recorded (the agent's fields, plus the write it is and its
    class at proposal) and that class; (None, None) for the default undo."""
    if spec.compensation is None:
        return None, None
    proposal = spec.proposal
    operation = compensation_operation(proposal.operation, str(spec.compensation["method"]))
    cls = proposal.kind.class_for(operation)
    recorded = {
        **copy.deepcopy(spec.compensation),
        "operation": operation,
        "conflict_class": cls.slug,
    }
    return recorded, cls


def plan_escalation_group(plan_id: uuid.UUID) -> str:
    """Whom an overdue plan approval escalates to: the first escalation group among its
    steps' classes, in step order ("" when none names one)."""
    groups = (
        PlanStep.objects.filter(plan_id=plan_id)
        .exclude(conflict_class__escalation_group="")
        .order_by("position")
        .values_list("conflict_class__escalation_group", flat=True)
    )
    return str(groups.first() or "")


def plan_forbids_owner_approval(plan: Plan) -> bool:
    """Separation of duties for the plan's approval: the strictest of its classes."""
    return any(c.forbid_agent_owner_approval for c in _plan_classes(plan))


@dataclass(frozen=True)
class RecordedPlan:
    """A plan's rows as plan_rows_create wrote them: the plan, every class its steps and
    explicit compensations are (what its approval asks), and the steps as the trail
    records them."""

    plan: Plan
    classes: list[ConflictClass]
    steps: list[dict[str, Any]]

    @property
    def needs_approval(self) -> bool:
        return any(c.approval_mode == ApprovalMode.PER_CALL for c in self.classes)


def plan_rows_create(
    run: Run,
    steps: Sequence[PlanStepSpec],
    observed: list[str | None],
    *,
    status: str | None = None,
    **plan_fields: Any,
) -> RecordedPlan:
    """The plan row (`status`, else by its classes: waiting for approval or executing)
    and its steps, each bound to its `observed` version and its kind's class now."""
    classes = [spec.proposal.kind.class_for(spec.proposal.operation) for spec in steps]
    compensations = [_recorded_compensation(spec) for spec in steps]
    # A compensation is a write like any other: its class counts with the steps'.
    every_class = classes + [cls for _, cls in compensations if cls is not None]
    needs_approval = any(c.approval_mode == ApprovalMode.PER_CALL for c in every_class)
    if status is None:
        status = PlanStatus.PENDING_APPROVAL if needs_approval else PlanStatus.EXECUTING
    plan = Plan.objects.create(run=run, agent_id=run.agent_id, status=status, **plan_fields)
    PlanStep.objects.bulk_create(
        PlanStep(
            plan=plan,
            position=position,
            **spec.proposal.columns(
                observed_version=observed[position - 1], conflict_class=classes[position - 1]
            ),
            compensation=compensations[position - 1][0],
        )
        for position, spec in enumerate(steps, start=1)
    )
    summary = [
        {
            "position": position,
            "resource": spec.proposal.resource_identifier,
            "operation": spec.proposal.operation,
            "observed_version": observed[position - 1],
            "conflict_class": classes[position - 1].slug,
            "compensation": _compensation_summary(compensations[position - 1]),
        }
        for position, spec in enumerate(steps, start=1)
    ]
    return RecordedPlan(plan=plan, classes=every_class, steps=summary)


def _record(
    run: Run,
    steps: Sequence[PlanStepSpec],
    observed: list[str | None],
    *,
    reason: str,
    idempotency_key: str,
) -> Plan:
    recorded = plan_rows_create(
        run, steps, observed, reason=reason, idempotency_key=idempotency_key
    )
    plan = recorded.plan
    audit_append(
        event_type="plan.proposed",
        actor=Actor.run(run),
        run_id=run.pk,
        details={
            "plan": str(plan.pk),
            "steps": recorded.steps,
            "approval": "per_call" if recorded.needs_approval else "per_run",
            "idempotency_key": idempotency_key,
            "reason": reason,
        },
    )
    if recorded.needs_approval:
        _approval_open_for_plan(plan, recorded.classes)
    else:
        plan_id = plan.pk
        transaction.on_commit(lambda: enqueue_plan_advance(plan_id))
    return plan


def _compensation_summary(
    compensation: tuple[dict[str, Any] | None, ConflictClass | None],
) -> dict[str, Any]:
    """What the trail records of a step's compensation: the method, the write it is
    and its class (the document itself is on the step, the trail keeps the shape)."""
    recorded, cls = compensation
    if recorded is None or cls is None:
        return {"method": "undo"}
    return {
        "method": recorded["method"],
        "operation": recorded["operation"],
        "conflict_class": cls.slug,
        "approval_mode": cls.approval_mode,
    }


def _approval_open_for_plan(plan: Plan, classes: Sequence[ConflictClass]) -> Approval:
    """One pending approval for the whole plan, with its strictest class's terms."""
    strictest = plan_strictest_terms(classes)
    now = timezone.now()
    escalation = strictest["escalation_seconds"]
    approval = Approval.objects.create(
        subject=ApprovalSubject.PLAN,
        run_id=plan.run_id,
        plan=plan,
        quorum=strictest["quorum"],
        expires_at=now + timedelta(seconds=strictest["ttl_seconds"]),
        escalate_at=now + timedelta(seconds=escalation) if escalation else None,
    )
    audit_append(
        event_type="approval.requested",
        actor=Actor.system(),
        run_id=plan.run_id,
        details=approval_details(
            approval,
            plan=str(plan.pk),
            conflict_classes=sorted({c.slug for c in classes}),
        ),
    )
    return approval


def plan_propose(
    *,
    run: Run,
    steps: Sequence[PlanStepSpec],
    reason: str = "",
    idempotency_key: str = "",
    on_recorded: Callable[[Plan], None] | None = None,
    on_refused: Callable[[DomainError], None] | None = None,
) -> Plan:
    """Check every step and record the plan whole, in one transaction.

    Raises ValidationFailed (422: no steps, too many, a duplicate resource, a bad
    compensation or one with nothing to apply to), PreconditionRequired
    (428), RunNotActive (409), Forbidden `not_in_write_set` (403: a step, or its
    compensation — `field: compensation` — outside the write set), Leased (423) — each
    naming the `step` —
    and the 412 `stale_version` of the first stale step (audited
    `plan.refused_stale`, `on_refused` inside that transaction). Nothing is
    recorded on a refusal. On success `on_recorded` runs inside the transaction.
    A step on an external target (issue 39) is checked against what the target holds:
    its mirror is read from the target first, outside the transaction (502
    `target_unavailable` / `weak_validator` naming the `step` when it cannot be).
    """
    plan_steps_shape_check(steps)
    plan_mirrors_refresh(steps)
    # As action_propose: the events are appended together last, so the audit head is
    # locked for the commit only, not while the answer is rendered and stored for replay.
    with transaction.atomic(), audit_deferred():
        _lock_and_check_authority(run, steps)
        observed = plan_observed_versions(steps)
        if not isinstance(observed, DomainError):
            plan = _record(run, steps, observed, reason=reason, idempotency_key=idempotency_key)
            if on_recorded is not None:
                on_recorded(plan)
            return plan
        refused = observed
        audit_append(
            event_type="plan.refused_stale",
            actor=Actor.run(run),
            resource=str(refused.extra.get("resource", "")),
            run_id=run.pk,
            details={
                "step": refused.extra.get("step"),
                "expected_etag": refused.extra.get("expected_etag"),
                "current_etag": refused.extra.get("current_etag"),
                "idempotency_key": idempotency_key,
            },
        )
        if on_refused is not None:
            on_refused(refused)
    raise refused


# --- What approvers see --------------------------------------------------------


@dataclass(frozen=True)
class StepPreview:
    """A step and its compensation as diffs against the version the agent observed
    (a create observed nothing: `{}`). `observed_recorded` is False when that version's
    document is not on record (a seeded resource): the diffs are then against `{}`."""

    observed_document: dict[str, Any]
    observed_recorded: bool
    result: dict[str, Any]  # the document after the step ({} once deleted)
    diff: list[dict[str, Any]]  # observed -> after the step
    compensation_result: dict[str, Any]  # after the compensation ({} once deleted)
    compensation_deletes: bool
    compensation_diff: list[dict[str, Any]]  # observed -> after the compensation


def _observed_document(step: PlanStep, resource: Resource | None) -> tuple[dict[str, Any], bool]:
    if step.observed_version is None:
        return {}, True
    if resource is None:
        return {}, False
    if resource.token == step.observed_version:
        live = resource.document if isinstance(resource.document, dict) else {}
        return ({} if resource.deleted else copy.deepcopy(live)), True
    row = revision_at(resource, step.observed_version)
    if row is None:
        return {}, False
    return ({} if row.deleted or not isinstance(row.document, dict) else row.document), True


def plan_step_preview(step: PlanStep, resource: Resource | None) -> StepPreview:
    """What `step` writes and what its compensation writes, each as a diff against the
    version observed (`resource`: the step's resource as it is now, None if absent)."""
    observed, recorded = _observed_document(step, resource)
    result = proposed_document(step, observed)
    compensation = step.compensation if isinstance(step.compensation, dict) else None
    method = (compensation or {}).get("method")
    if compensation is None:  # the undo: back to the observed version (a create: deleted)
        after, deletes = copy.deepcopy(observed), step.observed_version is None
    elif method == "DELETE":
        after, deletes = {}, True
    elif method == "PUT":
        after, deletes = copy.deepcopy(compensation.get("document") or {}), False
    else:
        patched = apply_merge_patch(result, compensation.get("patch") or {})
        after, deletes = (patched if isinstance(patched, dict) else {}), False
    return StepPreview(
        observed_document=observed,
        observed_recorded=recorded,
        result=result,
        diff=document_diff(observed, result),
        compensation_result={} if deletes else after,
        compensation_deletes=deletes,
        compensation_diff=document_diff(observed, {} if deletes else after),
    )


# --- The plan's approval, decided by approvals.services.decisions -------------


def plan_admit_locked(*, plan_id: uuid.UUID, actor: Actor, approval: Approval) -> bool:
    """The plan's approval reached its quorum (caller's transaction, plan row locked):
    it starts executing after commit. False when it was no longer waiting."""
    moved = plan_touch(
        plan_id=plan_id,
        run_id=approval.run_id,
        from_statuses=(PlanStatus.PENDING_APPROVAL,),
        status=PlanStatus.EXECUTING,
    )
    if moved:
        transaction.on_commit(lambda: enqueue_plan_advance(plan_id))
    audit_append(
        event_type="approval.approved",
        actor=actor,
        run_id=approval.run_id,
        details=approval_details(approval, plan=str(plan_id), queued=moved),
    )
    return moved
