"""Approve with edits: a person changes an agent's proposed write, then approves it.

The edit becomes a new action in the same run, bound to the version the agent observed,
recorded as the editor's (who, and the diff from the proposal to the approved write); the
original ends `superseded` with a link to it (its long-poll wakes through the status
change). The edited write passes every check an agent's write passes, through the same
code (actions.proposal_checked_locked: run active, write set, leases, the kind's class for
its operation, the bound version, writes queued over it), and the JSON and size limits of
an API body (engine/core/jsonsafe, AIRLOCK_MAX_BODY_BYTES). The editor's decision is the
edited action's first vote: with a quorum of one it approves it, above one another person
must approve the edited version. A plan's step is edited by approvals/services/
plan_edits.py, the same way.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Approval,
    ApprovalDecision,
    ApprovalStatus,
    ApprovalSubject,
    Run,
)
from approvals.outbox import enqueue_action_execution
from approvals.services.action_status import action_transition
from approvals.services.actions import Proposal, proposal_checked_locked
from approvals.services.approval_open import approval_details, approval_open_for_edit
from approvals.services.preconditions import parse_tag_condition
from approvals.services.queued_writes import lock_resource_for_proposal
from approvals.services.separation import check_separation_of_duties
from approvals.services.write_sets import lock_kind_for_proposal
from audit.services import Actor, audit_deferred
from console.permissions import person_of
from console.requestctx import current_request_id
from engine.core import jsonsafe
from engine.core.action_audit import audit_action_event
from engine.core.errors import (
    DomainError,
    InvalidTransition,
    NotFound,
    ValidationFailed,
    text_within,
)
from engine.core.write_rows import lock_run_for_share
from ownership.diff import apply_merge_patch, document_diff

# As decisions.MAX_COMMENT_LENGTH (a decision's comment).
MAX_COMMENT_LENGTH = 2000


class EditTooLarge(DomainError):
    code = "payload_too_large"
    status = 413


@dataclass(frozen=True)
class Edited:
    """What an edit left: the original's approval (cancelled: its action is superseded),
    the edited action, and the edited action's approval (approved, or pending another
    person), with its approving votes (the editor's: one)."""

    original_approval: Approval
    original: Action
    edited: Action
    approval: Approval
    approvals_so_far: int = 1


def _invalid(message: str, *, field: str) -> ValidationFailed:
    return ValidationFailed(message, extra={"errors": [{"field": field, "message": message}]})


def edited_payload(*, proposed: Any, document: Any = None, patch: Any = None) -> dict[str, Any]:
    """The write as the person approves it: `document` in place of the proposed one, or
    the merge patch `patch` applied to it. Held to an API body's limits: a JSON object,
    within jsonsafe's limits (checked on its encoding, whoever built it) and at most
    AIRLOCK_MAX_BODY_BYTES encoded. Raises ValidationFailed (422) or EditTooLarge (413)."""
    if (document is None) == (patch is None):
        raise _invalid("Send the edited `document` or a merge `patch`, not both.", field="document")
    field = "document" if document is not None else "patch"
    given = document if document is not None else patch
    if not isinstance(given, dict):
        raise _invalid(f"`{field}` must be a JSON object.", field=field)
    payload = given if document is not None else apply_merge_patch(proposed or {}, patch)
    if not isinstance(payload, dict):
        raise _invalid("The edited write must be a JSON object.", field=field)
    try:
        encoded = json.dumps(payload, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise _invalid(
            "The edited write is not JSON (a NaN or infinite number).", field=field
        ) from exc
    limit = int(settings.AIRLOCK_MAX_BODY_BYTES)
    if len(encoded.encode()) > limit:
        raise EditTooLarge(
            f"The edited write is larger than {limit} bytes.", extra={"limit_bytes": limit}
        )
    # The one parser's limits (depth, key and string lengths, numbers, NUL, surrogates).
    checked = jsonsafe.loads(encoded, field=field)
    assert isinstance(checked, dict)
    return checked


def approval_approve_with_edits(
    *,
    approval_id: uuid.UUID | str,
    actor: Actor,
    document: Any = None,
    patch: Any = None,
    comment: str = "",
    person: Any = None,
) -> Edited:
    """Approve a per-call approval's write as edited by `actor` (a person).

    Lock order (actions.action_propose's, then decisions'): the kind (shared) and resource
    proposal locks, the run FOR SHARE, the original action and its approval FOR UPDATE,
    the audit head last. Raises NotFound; ValidationFailed (422: not a single write's
    approval, a delete, an edit that changes nothing, a bad document or patch);
    EditTooLarge (413); Forbidden (`forbidden`, `self_approval`: separation of duties as
    for approving); InvalidTransition (409: already decided, expired, this person voted);
    and the agent's write's refusals (409 run_not_active, 403 not_in_write_set, 423
    leased, 404, 412 stale_version: the resource moved since the observed version). A
    refusal changes nothing.
    """
    comment = text_within(comment, field="comment", limit=MAX_COMMENT_LENGTH)
    try:
        approval_uuid = uuid.UUID(str(approval_id))
    except ValueError as exc:
        raise NotFound("No such approval.") from exc
    if person is None or not person.is_active or Actor.person(person) != actor:
        person = person_of(actor)
    found = Approval.objects.filter(pk=approval_uuid).values_list("subject", "action_id").first()
    if found is None:
        raise NotFound("No such approval.")
    subject, action_id = found
    if subject != ApprovalSubject.ACTION or action_id is None:
        if subject == ApprovalSubject.PLAN:
            # A plan is edited one step at a time (approvals/services/plan_edits.py).
            raise _invalid(
                "A plan's approval is edited one step at a time: name the `step` (its "
                "position) whose document or patch you send.",
                field="step",
            )
        raise _invalid(
            f"Only a single write's or a plan step's approval can be approved with edits, "
            f"not a {subject}'s; approve or reject it as proposed.",
            field="decision",
        )
    unlocked = Action.objects.select_related(
        "kind__class_create", "kind__class_update", "kind__class_delete"
    ).get(pk=action_id)
    if unlocked.operation == "delete":
        raise _invalid("A delete has no document to edit.", field="decision")
    if unlocked.parent_id is not None:
        # Its conflict names this action as its resolution: resolve the conflict afresh.
        raise _invalid(
            "A conflict resolution cannot be edited; reject it and resolve the conflict again.",
            field="decision",
        )
    payload = edited_payload(proposed=unlocked.payload, document=document, patch=patch)
    with transaction.atomic(), audit_deferred():
        lock_kind_for_proposal(unlocked.kind_id)
        lock_resource_for_proposal(unlocked.kind_id, unlocked.name)
        # The run FOR SHARE, then the rows decided (decisions' order): who may decide and
        # whether it is still pending are answered before anything about the resource.
        lock_run_for_share(unlocked.run_id)
        original, approval = _lock_original(action_id, approval_uuid)
        _check_decidable(approval, original, person)
        run = Run.objects.select_related("agent").get(pk=unlocked.run_id)
        proposal = _proposal_of(unlocked, payload)
        conflict_class = unlocked.kind.class_for(unlocked.operation)
        # The agent's checks (raised, or the 412 returned), the run's share lock held.
        resource, observed, refused = proposal_checked_locked(
            run=run, proposal=proposal, conflict_class=conflict_class
        )
        if refused is not None:
            raise refused
        diff = document_diff(original.payload, payload)
        if not diff:
            raise _invalid(
                "The edit changes nothing; approve the write as proposed.", field="document"
            )
        now = timezone.now()
        quorum = max(approval.quorum, conflict_class.quorum)
        edited = Action.objects.create(
            **proposal.columns(observed_version=observed, conflict_class=conflict_class),
            run=run,
            agent_id=run.agent_id,
            resource=resource,
            status=ActionStatus.QUEUED if quorum <= 1 else ActionStatus.PENDING_APPROVAL,
            reason=original.reason,
            request_id=current_request_id()[:128],
            edited_by=person,
            edit={
                "by": person.get_username(),
                "supersedes": str(original.pk),
                "approval": str(approval.pk),
                "comment": comment,
                "diff": diff,
            },
        )
        action_transition(
            action_id=original.pk,
            from_statuses=(ActionStatus.PENDING_APPROVAL,),
            to_status=ActionStatus.SUPERSEDED,
            superseded_by=edited,
        )
        Approval.objects.filter(pk=approval.pk).update(
            status=ApprovalStatus.CANCELLED, decided_at=now
        )
        approval.status, approval.decided_at = ApprovalStatus.CANCELLED, now
        editor = Actor.person(person)
        audit_action_event(
            original,
            event_type="approval.decision_approve_with_edits",
            actor=editor,
            details={
                "approval": str(approval.pk),
                "subject": "action",
                "comment": comment,
                "edited_action": str(edited.pk),
            },
        )
        audit_action_event(
            original,
            event_type="action.superseded",
            actor=editor,
            details={"superseded_by": str(edited.pk), "approval": str(approval.pk)},
        )
        audit_action_event(
            edited,
            event_type="action.edited",
            actor=editor,
            details={
                "supersedes": str(original.pk),
                "editor": person.get_username(),
                "comment": comment,
                "diff": diff,
                "operation": edited.operation,
                "observed_etag": edited.observed_etag,
                "conflict_class": conflict_class.slug,
            },
        )
        new_approval = approval_open_for_edit(
            action=edited, quorum=quorum, person_id=person.pk, comment=comment
        )
        if new_approval.status == ApprovalStatus.APPROVED:
            audit_action_event(
                edited,
                event_type="approval.approved",
                actor=editor,
                details=approval_details(
                    new_approval, observed_version=edited.observed_version, queued=True
                ),
            )
            edited_id = edited.pk
            transaction.on_commit(lambda: enqueue_action_execution(edited_id))
    original.status, original.superseded_by = ActionStatus.SUPERSEDED, edited
    return Edited(
        original_approval=approval, original=original, edited=edited, approval=new_approval
    )


def _proposal_of(action: Action, payload: dict[str, Any]) -> Proposal:
    """The edited write as the agent's proposal would be: the same resource, operation
    and format, conditioned on the version the agent observed (a create: on its absence)."""
    observed = action.observed_version
    return Proposal(
        kind=action.kind,
        name=action.name,
        operation=action.operation,
        payload_format=action.payload_format,
        payload=payload,
        if_match=(
            None if observed is None else parse_tag_condition(f'"{observed}"', header="If-Match")
        ),
        create_if_absent=action.operation == "create",
        idempotency_key="",
        reason=action.reason,
    )


def _lock_original(action_id: uuid.UUID, approval_id: uuid.UUID) -> tuple[Action, Approval]:
    """The original action, then its approval, FOR UPDATE (decisions' order, after the run)."""
    original = Action.objects.select_for_update(of=("self",)).get(pk=action_id)
    approval = (
        Approval.objects.select_for_update(of=("self",))
        .select_related("run__agent", "action__conflict_class")
        .get(pk=approval_id)
    )
    return original, approval


def check_vote_open(approval: Approval, person: Any) -> None:
    """What any edit of an approval's subject needs before anything else: separation of
    duties as for approving, the approval still pending and not expired, and this person
    not yet counted on it (the single write's edit here, a plan step's in plan_edits)."""
    check_separation_of_duties(approval=approval, person=person)
    if approval.status != ApprovalStatus.PENDING:
        raise InvalidTransition(
            f"This approval is already {approval.status}.",
            code="already_decided",
            extra={"approval_status": approval.status},
        )
    if approval.expires_at <= timezone.now():
        raise InvalidTransition("This approval has expired.", code="approval_expired")
    if ApprovalDecision.objects.filter(approval=approval, person=person).exists():
        raise InvalidTransition(
            "You have already decided this approval; a person counts once.",
            code="already_decided",
        )


def _check_decidable(approval: Approval, original: Action, person: Any) -> None:
    """check_vote_open, then: the action still waits for approval."""
    check_vote_open(approval, person)
    if original.status != ActionStatus.PENDING_APPROVAL:
        raise InvalidTransition(
            f"Action {original.pk} is {original.status}; only a write awaiting approval "
            "can be edited.",
            extra={"action_status": original.status},
        )
