"""Opening approvals: the one place an Approval row is created.

A leaf of the services layer (models, audit, run policy only): runs, actions,
decisions and ownership's conflict resolution all import it at the top. Every
function runs inside the caller's transaction.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from approvals.models import (
    Action,
    Approval,
    ApprovalDecision,
    ApprovalStatus,
    ApprovalSubject,
    Decision,
    Run,
)
from approvals.services.run_policy import classes_for_write_set, run_quorum
from audit.services import Actor, audit_append
from engine.core.action_audit import audit_action_event
from ownership.models import ApprovalMode, Conflict, ConflictClass


def approval_open_for_run(*, run: Run) -> Approval:
    """A pending run approval, audited `approval.requested`.

    Its quorum is the highest quorum among the per-run classes the write set
    touches (run_policy.run_quorum), fixed when the approval opens, as a
    per-call approval's is.
    """
    now = timezone.now()
    classes = classes_for_write_set(run.write_set or [])
    quorum = run_quorum(classes)
    approval = Approval.objects.create(
        subject=ApprovalSubject.RUN,
        run=run,
        quorum=quorum,
        expires_at=now + timedelta(seconds=settings.AIRLOCK_RUN_APPROVAL_TTL_SECONDS),
    )
    audit_append(
        event_type="approval.requested",
        actor=Actor.system(),
        run_id=run.pk,
        details=approval_details(approval, conflict_classes=[klass.slug for klass in classes]),
    )
    return approval


def approval_open_for_action(*, action: Action, from_conflict: Conflict | None = None) -> Approval:
    """A pending per-call approval bound to the action's observed version, audited
    `approval.requested`; quorum, TTL and escalation come from the action's class."""
    cls = action.conflict_class
    now = timezone.now()
    approval = _action_approval_create(
        action,
        quorum=cls.quorum,
        expires_at=now + timedelta(seconds=cls.approval_ttl_seconds),
        escalate_at=(
            now + timedelta(seconds=cls.escalation_seconds) if cls.escalation_seconds else None
        ),
        from_conflict=from_conflict,
    )
    details = approval_details(
        approval, observed_version=action.observed_version, conflict_class=cls.slug
    )
    if from_conflict is not None:
        details["conflict"] = str(from_conflict.pk)
    audit_action_event(
        action,
        event_type="approval.requested",
        actor=Actor.system(),
        details=details,
    )
    return approval


def approval_details(approval: Approval, **more: Any) -> dict[str, Any]:
    """What an approval's audit events name first: the approval, its subject, its quorum."""
    return {
        "approval": str(approval.pk),
        "subject": str(approval.subject),
        "quorum": approval.quorum,
        **more,
    }


def resolution_needs_votes(conflict_class: ConflictClass) -> bool:
    """A person's resolution waits for more people when its class is per-call with a
    quorum above one (the resolver's decision is the first vote)."""
    return conflict_class.approval_mode == ApprovalMode.PER_CALL and conflict_class.quorum > 1


def approval_open_for_resolution(
    *, action: Action, conflict: Conflict, actor: Actor, comment: str
) -> Approval:
    """The approval of a person's conflict resolution (`action`, child of the refused one).

    The resolver's decision is its first vote. A per-call class that needs more
    than one person opens a pending approval (approval_open_for_action) and the
    action waits `pending_approval` until approval_decide reaches the quorum;
    otherwise the approval is recorded as already approved by the resolver (the
    caller audits `conflict.resolved`).
    """
    if resolution_needs_votes(action.conflict_class):
        approval = approval_open_for_action(action=action, from_conflict=conflict)
    else:
        now = timezone.now()
        approval = _action_approval_create(
            action,
            status=ApprovalStatus.APPROVED,
            quorum=1,
            expires_at=now,
            decided_at=now,
            from_conflict=conflict,
        )
    ApprovalDecision.objects.create(
        approval=approval, person_id=int(actor.id), decision=Decision.APPROVE, comment=comment
    )
    return approval


def approval_open_for_edit(
    *, action: Action, quorum: int, person_id: int, comment: str
) -> Approval:
    """The approval of an action a person edited before approving (approvals/services/
    edits.py): the editor's decision is its first vote. With a quorum of one the edit
    approves it (recorded approved; the caller queues the action and audits); above one it
    opens pending (approval_open_for_action's TTL and escalation) for another person."""
    if quorum > 1:
        cls = action.conflict_class
        now = timezone.now()
        approval = _action_approval_create(
            action,
            quorum=quorum,
            expires_at=now + timedelta(seconds=cls.approval_ttl_seconds),
            escalate_at=(
                now + timedelta(seconds=cls.escalation_seconds) if cls.escalation_seconds else None
            ),
        )
        audit_action_event(
            action,
            event_type="approval.requested",
            actor=Actor.system(),
            details=approval_details(
                approval, observed_version=action.observed_version, conflict_class=cls.slug
            ),
        )
    else:
        now = timezone.now()
        approval = _action_approval_create(
            action, status=ApprovalStatus.APPROVED, quorum=1, expires_at=now, decided_at=now
        )
    ApprovalDecision.objects.create(
        approval=approval, person_id=person_id, decision=Decision.APPROVE, comment=comment
    )
    return approval


def _action_approval_create(action: Action, **fields: Any) -> Approval:
    """An approval of one action, bound to the version the action observed."""
    return Approval.objects.create(
        subject=ApprovalSubject.ACTION,
        run_id=action.run_id,
        action=action,
        observed_version=action.observed_version,
        **fields,
    )
