"""Approve a plan with one step edited (issue 42 §1), as edits.py does for a single write.

A person changes one step's document (or merge-patches it) before approving a plan. The
edited plan is a NEW plan in the same run: every step as the agent proposed it but that
one, each bound to the version the agent observed, recorded as the editor's (who, which
step, the diff from the agent's step to the approved one). It passes every check
plan_propose makes on every step, through the same code (plans.py: shape and
compensations, write set and leases for steps and compensations, the kinds' classes now,
the observed versions and the writes queued over them) and an API body's limits
(edits.edited_payload). The original ends `superseded` with a link to the edited plan
(its long-poll wakes: the plan's ETag moves), nothing of it having run, and its approval
is cancelled. The editor's decision is the edited plan's first vote: with a quorum of one
it is admitted as an approved plan is (plans.plan_admit_locked), above one another
person must approve it. A refusal changes nothing.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from approvals.models import (
    Approval,
    ApprovalDecision,
    ApprovalStatus,
    ApprovalSubject,
    Decision,
    Plan,
    PlanStatus,
    PlanStep,
    PlanStepStatus,
    Run,
)
from approvals.services.actions import Proposal
from approvals.services.approval_open import approval_details
from approvals.services.edits import MAX_COMMENT_LENGTH, check_vote_open, edited_payload
from approvals.services.plan_state import plan_touch
from approvals.services.plans import (
    PlanStepSpec,
    RecordedPlan,
    plan_admit_locked,
    plan_mirrors_refresh,
    plan_observed_versions,
    plan_rows_create,
    plan_steps_authority_check,
    plan_steps_lock,
    plan_steps_shape_check,
    plan_strictest_terms,
)
from approvals.services.preconditions import parse_tag_condition
from audit.services import Actor, audit_append, audit_deferred
from console.permissions import person_of
from engine.core.errors import (
    DomainError,
    InvalidTransition,
    NotFound,
    ValidationFailed,
    text_within,
)
from ownership.diff import document_diff

# What an explicit compensation is as the agent sent it (the recorded one adds the write
# it is and its class, which plan_rows_create derives again).
_COMPENSATION_FIELDS = ("method", "document", "patch")


@dataclass(frozen=True)
class PlanEdited:
    """What a plan edit left: the original's approval (cancelled), the original plan
    (superseded), the edited plan, and its approval (approved, or pending another person)
    with its approving votes (the editor's: one)."""

    original_approval: Approval
    original: Plan
    edited: Plan
    approval: Approval
    approvals_so_far: int = 1


def _invalid(message: str, *, field: str) -> ValidationFailed:
    return ValidationFailed(message, extra={"errors": [{"field": field, "message": message}]})


def _position(step: Any) -> int:
    """The edited step's position, an integer from 1 (a bool is not one)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise _invalid("`step` is the edited step's position, an integer from 1.", field="step")
    return step


def _spec_of(step: PlanStep, payload: Any) -> PlanStepSpec:
    """A recorded step as the agent's proposal of it was (with `payload`), conditioned on
    the version the agent observed (a create: on its absence), with its compensation."""
    observed = step.observed_version
    compensation = None
    if isinstance(step.compensation, dict):
        compensation = {
            key: copy.deepcopy(value)
            for key, value in step.compensation.items()
            if key in _COMPENSATION_FIELDS
        }
    return PlanStepSpec(
        proposal=Proposal(
            kind=step.kind,
            name=step.name,
            operation=step.operation,
            payload_format=step.payload_format,
            payload=payload,
            if_match=(
                None
                if observed is None
                else parse_tag_condition(f'"{observed}"', header="If-Match")
            ),
            create_if_absent=step.operation == "create",
            idempotency_key="",
            reason="",
        ),
        compensation=compensation,
    )


def _edited_specs(
    plan_id: uuid.UUID, position: int, *, document: Any, patch: Any
) -> tuple[PlanStep, dict[str, Any], list[PlanStepSpec]]:
    """The step edited, its payload as approved, and the whole plan's steps as specs with
    that one changed. Raises ValidationFailed (422: no such step, a delete, a bad
    document or patch) or EditTooLarge (413)."""
    steps = list(
        PlanStep.objects.filter(plan_id=plan_id)
        .select_related("kind__class_create", "kind__class_update", "kind__class_delete")
        .order_by("position")
    )
    target = next((step for step in steps if step.position == position), None)
    if target is None:
        raise _invalid(
            f"The plan has no step {position}; its steps are 1 to {len(steps)}.", field="step"
        )
    if target.operation == "delete":
        raise _invalid(f"Step {position} is a delete: it has no document to edit.", field="step")
    payload = edited_payload(proposed=target.payload, document=document, patch=patch)
    specs = [
        _spec_of(step, payload if step is target else copy.deepcopy(step.payload)) for step in steps
    ]
    return target, payload, specs


def plan_approve_with_edits(
    *,
    approval_id: uuid.UUID | str,
    actor: Actor,
    step: Any,
    document: Any = None,
    patch: Any = None,
    comment: str = "",
    person: Any = None,
) -> PlanEdited:
    """Approve a plan's approval with its step at position `step` as edited by `actor`.

    Lock order (plan_propose's, then decisions'): the kinds (shared) and resources of
    every step, the run FOR SHARE, the original plan and its approval FOR UPDATE, the
    audit head last. Raises NotFound; ValidationFailed (422: not a plan's approval, no
    such step, a delete step, an edit that changes nothing, a bad document or patch);
    EditTooLarge (413); Forbidden (`forbidden`, `self_approval`: separation of duties as
    for approving the plan); InvalidTransition (409: already decided, expired, this
    person voted, the plan no longer waits); and plan_propose's refusals, naming the
    `step` (409 run_not_active, 403 not_in_write_set, 423 leased, 412 stale_version:
    a step's resource moved since the version observed). A refusal changes nothing.
    """
    comment = text_within(comment, field="comment", limit=MAX_COMMENT_LENGTH)
    try:
        approval_uuid = uuid.UUID(str(approval_id))
    except ValueError as exc:
        raise NotFound("No such approval.") from exc
    if person is None or not person.is_active or Actor.person(person) != actor:
        person = person_of(actor)
    found = (
        Approval.objects.filter(pk=approval_uuid)
        .values_list("subject", "plan_id", "run_id")
        .first()
    )
    if found is None:
        raise NotFound("No such approval.")
    subject, plan_id, run_id = found
    if subject != ApprovalSubject.PLAN or plan_id is None:
        raise _invalid(
            f"`step` names a step of a plan's approval; this is a {subject}'s.", field="step"
        )
    position = _position(step)
    target, payload, specs = _edited_specs(plan_id, position, document=document, patch=patch)
    # The proposal's shape checks (count, duplicates, preconditions, compensations) again:
    # a limit lowered since the agent proposed holds for the plan a person approves.
    plan_steps_shape_check(specs)
    # An external step's mirror holds the version observed (read from its target unless
    # it does): outside the transaction, as plan_propose reads it.
    plan_mirrors_refresh(specs)
    with transaction.atomic(), audit_deferred():
        run = Run.objects.select_related("agent").get(pk=run_id)
        status = plan_steps_lock(run, specs)
        # Who may decide, and whether it still waits, before anything about the resources.
        original, approval = _lock_original(plan_id, approval_uuid)
        _check_decidable(approval, original, person)
        plan_steps_authority_check(run, status, specs)
        observed = plan_observed_versions(specs)
        if isinstance(observed, DomainError):
            raise observed
        diff = document_diff(target.payload, payload)
        if not diff:
            raise _invalid(
                "The edit changes nothing; approve the plan as proposed.", field="document"
            )
        edit = {
            "by": person.get_username(),
            "supersedes": str(original.pk),
            "approval": str(approval.pk),
            "step": position,
            "resource": target.resource_identifier,
            "comment": comment,
            "diff": diff,
        }
        recorded = plan_rows_create(
            run,
            specs,
            observed,
            status=PlanStatus.PENDING_APPROVAL,
            reason=original.reason,
            idempotency_key="",
            edited_by=person,
            edit=edit,
        )
        edited = recorded.plan
        _supersede_locked(original, approval, edited)
        editor = Actor.person(person)
        _audit_edit(editor, approval, original, recorded, edit)
        new_approval = _approval_open_for_edit(
            recorded, quorum=approval.quorum, person=person, comment=comment
        )
    return PlanEdited(
        original_approval=approval, original=original, edited=edited, approval=new_approval
    )


def _lock_original(plan_id: uuid.UUID, approval_id: uuid.UUID) -> tuple[Plan, Approval]:
    """The original plan, then its approval, FOR UPDATE (decisions' order, after the run)."""
    original = Plan.objects.select_for_update(of=("self",)).get(pk=plan_id)
    approval = (
        Approval.objects.select_for_update(of=("self",))
        .select_related("run__agent", "plan")
        .get(pk=approval_id)
    )
    return original, approval


def _check_decidable(approval: Approval, original: Plan, person: Any) -> None:
    """edits.check_vote_open, then: the plan still waits for approval."""
    check_vote_open(approval, person)
    if original.status != PlanStatus.PENDING_APPROVAL:
        raise InvalidTransition(
            f"Plan {original.pk} is {original.status}; only a plan awaiting approval can be "
            "edited.",
            extra={"plan_status": original.status},
        )


def _supersede_locked(original: Plan, approval: Approval, edited: Plan) -> None:
    """The original plan ends `superseded` by `edited` (its ETag moves: its long-poll
    wakes), none of its steps having run; its approval is cancelled."""
    now = timezone.now()
    plan_touch(
        plan_id=original.pk,
        run_id=original.run_id,
        from_statuses=(PlanStatus.PENDING_APPROVAL,),
        status=PlanStatus.SUPERSEDED,
        superseded_by=edited,
        ended_at=now,
    )
    PlanStep.objects.filter(plan_id=original.pk).update(status=PlanStepStatus.SKIPPED)
    original.status, original.superseded_by, original.ended_at = (
        PlanStatus.SUPERSEDED,
        edited,
        now,
    )
    Approval.objects.filter(pk=approval.pk).update(status=ApprovalStatus.CANCELLED, decided_at=now)
    approval.status, approval.decided_at = ApprovalStatus.CANCELLED, now


def _audit_edit(
    editor: Actor,
    approval: Approval,
    original: Plan,
    recorded: RecordedPlan,
    edit: dict[str, Any],
) -> None:
    """The decision, the supersession and the edit (its author, step and diff), in order."""
    edited = recorded.plan
    audit_append(
        event_type="approval.decision_approve_with_edits",
        actor=editor,
        resource=str(edit["resource"]),
        run_id=original.run_id,
        details={
            "approval": str(approval.pk),
            "subject": "plan",
            "plan": str(original.pk),
            "step": edit["step"],
            "comment": edit["comment"],
            "edited_plan": str(edited.pk),
        },
    )
    audit_append(
        event_type="plan.superseded",
        actor=editor,
        run_id=original.run_id,
        details={
            "plan": str(original.pk),
            "superseded_by": str(edited.pk),
            "approval": str(approval.pk),
        },
    )
    audit_append(
        event_type="plan.edited",
        actor=editor,
        resource=str(edit["resource"]),
        run_id=original.run_id,
        details={
            "plan": str(edited.pk),
            "supersedes": str(original.pk),
            "editor": edit["by"],
            "step": edit["step"],
            "comment": edit["comment"],
            "diff": edit["diff"],
            "steps": recorded.steps,
        },
    )


def _approval_open_for_edit(
    recorded: RecordedPlan, *, quorum: int, person: Any, comment: str
) -> Approval:
    """The edited plan's approval, on its classes' strictest terms now (its quorum never
    below the original's): the editor's decision is its first vote. With a quorum of one
    the plan is admitted as an approved plan is; above one it waits for another person."""
    plan = recorded.plan
    terms = plan_strictest_terms(recorded.classes)
    quorum = max(quorum, int(terms["quorum"]))
    now = timezone.now()
    escalation = terms["escalation_seconds"]
    approval = Approval.objects.create(
        subject=ApprovalSubject.PLAN,
        run_id=plan.run_id,
        plan=plan,
        quorum=quorum,
        expires_at=now + timedelta(seconds=terms["ttl_seconds"]),
        escalate_at=now + timedelta(seconds=escalation) if escalation else None,
    )
    ApprovalDecision.objects.create(
        approval=approval, person_id=person.pk, decision=Decision.APPROVE, comment=comment
    )
    if quorum > 1:
        audit_append(
            event_type="approval.requested",
            actor=Actor.system(),
            run_id=plan.run_id,
            details=approval_details(
                approval,
                plan=str(plan.pk),
                conflict_classes=sorted({c.slug for c in recorded.classes}),
            ),
        )
        return approval
    Approval.objects.filter(pk=approval.pk).update(status=ApprovalStatus.APPROVED, decided_at=now)
    approval.status, approval.decided_at = ApprovalStatus.APPROVED, now
    plan_admit_locked(plan_id=plan.pk, actor=Actor.person(person), approval=approval)
    return approval
