"""Deciding approvals: one person's vote, quorum, rejection, expiry and escalation.

Approvals are opened by approvals.services.approval_open (inside the transaction
that creates the run or the action).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Approval,
    ApprovalStatus,
    ApprovalSubject,
    Decision,
    Plan,
    PlanStatus,
    Run,
    RunStatus,
)
from approvals.notify import notify_run_changed
from approvals.outbox import enqueue_action_execution, notify_action_on_commit
from approvals.services.action_status import action_transition
from approvals.services.approval_open import approval_details
from approvals.services.decision_rows import (
    LockedCall,
    lock_call_approval,
    rejection_error,
    vote_cast,
)
from approvals.services.edits import Edited, approval_approve_with_edits
from approvals.services.grants import grant_create_locked, grant_request_checked
from approvals.services.plan_edits import PlanEdited, plan_approve_with_edits
from approvals.services.plan_state import plan_end_unapproved_locked, plan_touch
from approvals.services.plans import (
    plan_admit_locked,
    plan_escalation_group,
)
from approvals.services.runs import run_activate, run_reject
from approvals.services.separation import check_separation_of_duties
from approvals.services.write_sets import entries_of, lock_kinds
from audit.services import Actor, audit_append, audit_deferred
from console.permissions import person_of
from console.tracing import traced_decide
from engine.core.action_audit import audit_action_event
from engine.core.errors import (
    InvalidTransition,
    NotFound,
    ValidationFailed,
    text_within,
)
from engine.core.write_rows import lock_run_for_share
from ownership.models import OwnershipRecord, Resource
from ownership.reopen import conflict_reopen_for_resolution

escalation_log = logging.getLogger("airlock.escalation")

# Not a recorded decision (ApprovalDecision.decision): the verb of approvals/services/edits.py.
APPROVE_WITH_EDITS = "approve_with_edits"

# A person's comment on a decision (an approval's vote, a conflict's resolution).
MAX_COMMENT_LENGTH = 2000


def _subject_identifier(approval: Approval) -> str:
    return approval.action.resource_identifier if approval.action is not None else ""


# What deciding (separation of duties, the transition, the answer) reads of each subject's
# rows besides the approval: joined into its locking read, nothing more (each column
# joined costs compiling the statement, on every decision).
_DECIDING_NEEDS: dict[str, tuple[str, ...]] = {
    ApprovalSubject.RUN: ("run__agent",),
    ApprovalSubject.ACTION: ("run__agent", "action__conflict_class"),
    ApprovalSubject.PLAN: ("run__agent", "plan"),
}


def _lock_approval_subject(approval_id: uuid.UUID) -> Approval:
    """Lock an approval and what deciding it changes, in the project's one lock order.

    Inside the caller's transaction. The order (every service that takes two of
    these takes them in this order; appending to the audit takes no lock):

      1. the per-kind advisory locks of a run approval's write set (as
         runs.run_create / run_activate take them);
      2. the run row: FOR UPDATE for a run approval (run_activate / _end update
         it), FOR SHARE for an action approval (a revoke or finish waits for us,
         or we see its end);
      3. the action row (FOR UPDATE), as actions.action_cancel does first — or,
         for a plan approval, the plan row (FOR UPDATE);
      4. the approval row (FOR UPDATE).

    `subject`, `run_id`, `action_id` and the run's write set never change, so
    they are read without a lock first. Raises Approval.DoesNotExist. A decision of
    an action's approval takes the same locks in one statement on PostgreSQL
    (decision_rows.lock_call_approval).
    """
    subject, run_id, action_id, plan_id = Approval.objects.values_list(
        "subject", "run_id", "action_id", "plan_id"
    ).get(pk=approval_id)
    if subject == ApprovalSubject.RUN:
        unlocked_run = Run.objects.only("pk", "write_set").get(pk=run_id)
        lock_kinds({entry.kind for entry in entries_of(unlocked_run)})
        list(Run.objects.select_for_update(of=("self",)).filter(pk=run_id).values_list("pk"))
    else:
        lock_run_for_share(run_id)
        if action_id is not None:
            list(
                Action.objects.select_for_update(of=("self",))
                .filter(pk=action_id)
                .values_list("pk")
            )
        if plan_id is not None:
            list(Plan.objects.select_for_update(of=("self",)).filter(pk=plan_id).values_list("pk"))
    return (
        Approval.objects.select_for_update(of=("self",))
        .select_related(*_DECIDING_NEEDS[subject])
        .get(pk=approval_id)
    )


def _lock_for_decision(
    approval_id: uuid.UUID, *, person: Any, now: datetime
) -> tuple[Approval, LockedCall | None]:
    """The approval locked as _lock_approval_subject locks it — an action's in one
    statement on PostgreSQL (decision_rows.lock_call_approval, which also reads what
    deciding and answering need: the LockedCall). Raises NotFound."""
    if connection.vendor == "postgresql":
        person_pk = person.pk if person is not None else None
        locked = lock_call_approval(approval_id, person_id=person_pk, now=now)
        if locked is None:
            raise NotFound("No such approval.")
        if isinstance(locked, LockedCall):
            return locked.approval, locked
    try:
        return _lock_approval_subject(approval_id), None
    except Approval.DoesNotExist as exc:
        raise NotFound("No such approval.") from exc


@dataclass(frozen=True)
class Decided:
    """What a decision left: the approval as locked and changed (its status and
    decided_at set; nothing else moves while it is locked), and the approving votes
    it now has. Enough to render the answer without reading the rows again — with
    `resource`, the call's resource as read under the locks, when `resource_read`."""

    approval: Approval
    approvals_so_far: int
    resource: Resource | None = None
    resource_read: bool = False


def _deciding_person(actor: Actor, person: Any) -> Any:
    """The active person `actor` names: `person` when the caller loaded that very user
    already (the API's token lookup finds active users only), else read (person_of)."""
    if person is not None and person.is_active and Actor.person(person) == actor:
        return person
    return person_of(actor)


def approval_decide(
    *,
    approval_id: uuid.UUID | str,
    actor: Actor,
    decision: str,
    comment: str = "",
    grant: dict[str, Any] | None = None,
) -> Approval:
    """approval_decide_tallied, for callers that want the approval only."""
    decided = approval_decide_tallied(
        approval_id=approval_id, actor=actor, decision=decision, comment=comment, grant=grant
    )
    return decided.approval


@traced_decide
def approval_decide_tallied(
    *,
    approval_id: uuid.UUID | str,
    actor: Actor,
    decision: str,
    comment: str = "",
    person: Any = None,
    edit: dict[str, Any] | None = None,
    grant: dict[str, Any] | None = None,
) -> Decided:
    """Record one person's decision; at quorum admit the run or queue the action.
    Returns the approval as decided and its approving votes so far (Decided).

    `approve_with_edits` (`edit`: {"document": ...} or {"patch": ...}) is edits'
    (approvals/services/edits.py): the answer is then the edited action's approval; with
    `"step": <position>` in `edit`, a plan's step is edited (approvals/services/
    plan_edits.py) and the answer is the edited plan's approval.

    `grant` (an approval only: {"uses", "ttl_seconds", "name_prefix", "scope"?,
    "reason"?}): the approving person also grants standing approval for writes like this
    one (approvals/services/grants.py), in the same transaction: refused (and nothing
    decided) when the approval cannot grant or the grant is wider than allowed.

    `person`: the user `actor` names, if the caller has it loaded (saves a read).
    Takes its locks first, in the project's one order (_lock_approval_subject:
    kind advisory locks, run, action, approval), and appends audit events only
    after them, so it never deadlocks with run_create, action_cancel, a revoke
    or the expiry sweep. Raises NotFound, Forbidden
    (`forbidden`, `self_approval`), ValidationFailed (bad decision/comment),
    InvalidTransition (409: already decided, expired, or this person already
    voted). Enqueues the action's job on commit.
    """
    if grant is not None and decision != Decision.APPROVE:
        raise ValidationFailed(
            "`grant` goes with approve only.",
            extra={"errors": [{"field": "grant", "message": "not expected"}]},
        )
    if decision == APPROVE_WITH_EDITS:
        edit = edit or {}
        # With a `step`, one step of a plan's approval; without, a single write's.
        edited: Edited | PlanEdited = (
            plan_approve_with_edits(
                approval_id=approval_id, actor=actor, comment=comment, person=person, **edit
            )
            if "step" in edit
            else approval_approve_with_edits(
                approval_id=approval_id, actor=actor, comment=comment, person=person, **edit
            )
        )
        return Decided(approval=edited.approval, approvals_so_far=edited.approvals_so_far)
    if decision not in (Decision.APPROVE, Decision.REJECT):
        raise ValidationFailed(
            "decision must be 'approve', 'reject' or 'approve_with_edits'",
            extra={"errors": [{"field": "decision", "message": "approve or reject"}]},
        )
    grant_request = grant_request_checked(grant)
    comment = text_within(comment, field="comment", limit=MAX_COMMENT_LENGTH)
    try:
        approval_uuid = uuid.UUID(str(approval_id))
    except ValueError as exc:
        raise NotFound("No such approval.") from exc
    person = _deciding_person(actor, person)
    expired = False
    approves = 0
    # The decision's events (the vote, then what quorum did) are appended together by the
    # transaction's last statement (one INSERT; audit/linker.py links them after the commit).
    with transaction.atomic(), audit_deferred():
        approval, call = _lock_for_decision(approval_uuid, person=person, now=timezone.now())
        check_separation_of_duties(
            approval=approval,
            person=person,
            minted_live_token=call.minted_live_token if call is not None else None,
        )
        if approval.status != ApprovalStatus.PENDING:
            raise InvalidTransition(
                f"This approval is already {approval.status}.",
                code="already_decided",
                extra={"approval_status": approval.status},
            )
        now = timezone.now()
        if approval.expires_at <= now:
            _expire_locked(approval=approval, now=now)
            expired = True
        else:
            voted, approves, by_vote = vote_cast(
                approval, person, (decision, comment), now=now, one_statement=call is not None
            )
            if voted:
                raise InvalidTransition(
                    "You have already decided this approval; a person counts once.",
                    code="already_decided",
                )
            approves += decision == Decision.APPROVE
            vote = (decision, comment)
            _act_on_vote(approval, person, vote, approves=approves, now=now, by_vote=by_vote)
            if grant_request is not None:
                # Raises (rolling the vote back with it) when this approval cannot grant.
                grant_create_locked(
                    approval=approval,
                    person=person,
                    request=grant_request,
                    comment=comment,
                    now=now,
                )
    if expired:
        raise InvalidTransition("This approval has expired.", code="approval_expired")
    if call is not None:
        return Decided(approval, approves, resource=call.resource, resource_read=True)
    return Decided(approval=approval, approvals_so_far=approves)


def _act_on_vote(
    approval: Approval,
    person: Any,
    vote: tuple[str, str],
    *,
    approves: int,
    now: datetime,
    by_vote: bool | None = None,
) -> None:
    """The person's `vote` (decision, comment) on the locked approval is audited, then
    does what it does: a rejection rejects, the vote that reaches quorum (`approves`, this
    one counted) approves, any other is recorded. `by_vote` (vote_cast's moved_by_vote):
    not None when the vote's statement wrote that already, and whether it moved the action."""
    decision, comment = vote
    audit_append(
        event_type=f"approval.decision_{decision}",
        actor=Actor.person(person),
        resource=_subject_identifier(approval),
        run_id=approval.run_id,
        action_id=approval.action_id,
        details={
            "approval": str(approval.pk),
            "subject": approval.subject,
            **({"plan": str(approval.plan_id)} if approval.plan_id else {}),
            "comment": comment,
        },
    )
    if decision == Decision.REJECT:
        _reject_locked(approval=approval, person=person, comment=comment, now=now, by_vote=by_vote)
    elif approves >= approval.quorum:
        _approve_locked(approval=approval, person=person, now=now, by_vote=by_vote)
    else:
        _record_partial_vote(approval, now=now, by_vote=by_vote)


def _record_partial_vote(approval: Approval, *, now: datetime, by_vote: bool | None = None) -> None:
    """A vote below quorum changes what its subject's body shows (votes so far, who):
    move the action's ETag (its revision) so a 304 never hides it (the vote's statement
    did, when `by_vote` is not None), and wake the waiters."""
    if approval.action_id is not None:
        if by_vote is None:
            Action.objects.filter(pk=approval.action_id).update(
                revision=F("revision") + 1, updated_at=now
            )
        notify_action_on_commit(approval.action_id)
    elif approval.plan_id is not None:
        plan_touch(plan_id=approval.plan_id, run_id=approval.run_id)
    else:
        transaction.on_commit(partial(notify_run_changed, approval.run_id))


def _settle_locked(approval: Approval, status: str, *, now: datetime) -> None:
    """The locked approval is decided: the row, and the instance the answer renders."""
    Approval.objects.filter(pk=approval.pk).update(status=status, decided_at=now)
    approval.status, approval.decided_at = status, now


def _approve_locked(
    *, approval: Approval, person: Any, now: datetime, by_vote: bool | None = None
) -> None:
    actor = Actor.person(person)
    if approval.subject != ApprovalSubject.ACTION:
        _settle_locked(approval, ApprovalStatus.APPROVED, now=now)
    if approval.subject == ApprovalSubject.RUN:
        audit_append(
            event_type="approval.approved",
            actor=actor,
            run_id=approval.run_id,
            details=approval_details(approval),
        )
        run_activate(run=approval.run, actor=actor)
        return
    if approval.subject == ApprovalSubject.PLAN:
        assert approval.plan_id is not None
        plan_admit_locked(plan_id=approval.plan_id, actor=actor, approval=approval)
        return
    action, moved = _settle_call(
        approval, ApprovalStatus.APPROVED, ActionStatus.QUEUED, now=now, by_vote=by_vote
    )
    audit_action_event(
        action,
        event_type="approval.approved",
        actor=actor,
        details=approval_details(
            approval, observed_version=approval.observed_version, queued=moved
        ),
    )
    if moved:
        action_id = action.pk
        # The waiters are woken in the enqueue's Redis round trip (action_transition, on
        # the ORM path, woke them already).
        wake = by_vote is not None
        transaction.on_commit(lambda: enqueue_action_execution(action_id, wake=wake))


def _settle_call(
    approval: Approval,
    status: str,
    to_status: str,
    *,
    now: datetime,
    error: dict[str, Any] | None = None,
    by_vote: bool | None = None,
) -> tuple[Action, bool]:
    """The locked call approval is decided and its action leaves `pending_approval` for
    `to_status` (False: someone else moved it first) — action_transition's conditional
    UPDATE, which wakes the action's waiters; on PostgreSQL the vote's statement wrote
    both (`by_vote`: decision_rows._vote_settle_call) and the caller wakes them."""
    action = approval.action
    assert action is not None
    if by_vote is not None:
        approval.status, approval.decided_at = status, now
        return action, by_vote
    _settle_locked(approval, status, now=now)
    fields = {"error": error} if error is not None else {}
    moved = action_transition(
        action_id=action.pk,
        from_statuses=(ActionStatus.PENDING_APPROVAL,),
        to_status=to_status,
        **fields,
    )
    return action, moved


def _reject_locked(
    *, approval: Approval, person: Any, comment: str, now: datetime, by_vote: bool | None = None
) -> None:
    actor = Actor.person(person)
    if approval.subject != ApprovalSubject.ACTION:
        _settle_locked(approval, ApprovalStatus.REJECTED, now=now)
    error = rejection_error(person, comment)
    if approval.subject == ApprovalSubject.RUN:
        run_reject(run=approval.run, actor=actor, reason=comment or "rejected")
        audit_append(
            event_type="approval.rejected",
            actor=actor,
            run_id=approval.run_id,
            details={"approval": str(approval.pk), "subject": "run", "comment": comment},
        )
        return
    if approval.subject == ApprovalSubject.PLAN:
        assert approval.plan_id is not None
        plan_end_unapproved_locked(approval=approval, status=PlanStatus.REJECTED, error=error)
        audit_append(
            event_type="approval.rejected",
            actor=actor,
            run_id=approval.run_id,
            details={
                "approval": str(approval.pk),
                "subject": "plan",
                "plan": str(approval.plan_id),
                "comment": comment,
            },
        )
        return
    to_status = ActionStatus.REJECTED
    action, rejected = _settle_call(
        approval, ApprovalStatus.REJECTED, to_status, now=now, error=error, by_vote=by_vote
    )
    if rejected and by_vote is not None:
        notify_action_on_commit(action.pk)
    audit_action_event(
        action,
        event_type="approval.rejected",
        actor=actor,
        details={"approval": str(approval.pk), "subject": "action", "comment": comment},
    )
    if rejected and action.parent_id is not None:
        # A rejected resolution wrote nothing: its conflict is open again.
        conflict_reopen_for_resolution(
            action_id=action.pk, reason="resolution rejected", actor=actor
        )


def _expire_locked(*, approval: Approval, now: datetime) -> None:
    Approval.objects.filter(pk=approval.pk, status=ApprovalStatus.PENDING).update(
        status=ApprovalStatus.EXPIRED, decided_at=now
    )
    resource = ""
    reopen = False
    if approval.subject == ApprovalSubject.ACTION:
        assert approval.action is not None
        resource = approval.action.resource_identifier
        expired = action_transition(
            action_id=approval.action_id,  # type: ignore[arg-type]
            from_statuses=(ActionStatus.PENDING_APPROVAL,),
            to_status=ActionStatus.EXPIRED,
            error={"code": "approval_expired", "expired_at": now.isoformat()},
        )
        reopen = expired and approval.action.parent_id is not None
    elif approval.subject == ApprovalSubject.PLAN:
        assert approval.plan_id is not None
        plan_end_unapproved_locked(
            approval=approval,
            status=PlanStatus.EXPIRED,
            error={"code": "approval_expired", "expired_at": now.isoformat()},
        )
    else:
        updated = Run.objects.filter(pk=approval.run_id, status=RunStatus.PENDING_APPROVAL).update(
            status=RunStatus.EXPIRED, status_reason="approval expired", ended_at=now
        )
        if updated:
            transaction.on_commit(partial(notify_run_changed, approval.run_id))
            OwnershipRecord.objects.filter(run_id=approval.run_id, active=True).update(
                active=False, released_at=now
            )
    audit_append(
        event_type="approval.expired",
        actor=Actor.system(),
        resource=resource,
        run_id=approval.run_id,
        action_id=approval.action_id,
        details={
            "approval": str(approval.pk),
            "subject": approval.subject,
            **({"plan": str(approval.plan_id)} if approval.plan_id else {}),
        },
    )
    if reopen:
        # An expired resolution wrote nothing: its conflict is open again.
        conflict_reopen_for_resolution(
            action_id=approval.action_id,  # type: ignore[arg-type]
            reason="resolution approval expired",
            actor=Actor.system(),
        )


def approval_expire_due(*, now: datetime | None = None) -> dict[str, int]:
    """Expire pending approvals past their deadline; escalate those past escalate_at.

    Each approval is handled in its own short transaction, locked in the
    decision's order (_lock_approval_subject) and re-checked, so concurrent
    housekeepers never double-expire and a racing decision never deadlocks.
    """
    now = now or timezone.now()
    expired = escalated = 0
    due_ids = list(
        Approval.objects.filter(status=ApprovalStatus.PENDING, expires_at__lte=now)
        .order_by("expires_at")
        .values_list("pk", flat=True)[:500]
    )
    for approval_id in due_ids:
        with transaction.atomic():
            # The decision's lock order (run, action, approval): a decision racing
            # this expiry waits, or is waited for, and never deadlocks.
            due = _lock_approval_subject(approval_id)
            if due.status != ApprovalStatus.PENDING or due.expires_at > now:
                continue
            _expire_locked(approval=due, now=now)
            expired += 1
    escalate_ids = list(
        Approval.objects.filter(
            status=ApprovalStatus.PENDING, escalate_at__lte=now, escalated_at__isnull=True
        ).values_list("pk", flat=True)[:500]
    )
    for approval_id in escalate_ids:
        with transaction.atomic():
            approval = (
                Approval.objects.select_for_update(skip_locked=True, of=("self",))
                .select_related("action__conflict_class", "action__kind")
                .filter(pk=approval_id, status=ApprovalStatus.PENDING, escalated_at__isnull=True)
                .first()
            )
            if approval is None:
                continue
            group = ""
            if approval.action is not None:
                group = approval.action.conflict_class.escalation_group
            elif approval.plan_id is not None:
                group = plan_escalation_group(approval.plan_id)
            Approval.objects.filter(pk=approval.pk).update(escalated_at=now)
            audit_append(
                event_type="approval.escalated",
                actor=Actor.system(),
                resource=_subject_identifier(approval),
                run_id=approval.run_id,
                action_id=approval.action_id,
                details={"approval": str(approval.pk), "escalation_group": group},
            )
            escalation_log.warning(
                "approval %s pending past its escalation time; notifying group %r",
                approval.pk,
                group or "operators",
            )
            escalated += 1
    return {"expired": expired, "escalated": escalated}
