"""Undo on an external target (issue 39): a conditional write of the document from before the
action, on the version the action produced — never an overwrite.

- the action updated the document → `write(prior, expected_version=<result>)`;
- it created the document → `delete(expected_version=<result>)`;
- it deleted the document → `create(prior)` (only while nothing is there again).

`stale` at the target means someone changed it since: the undo's refusal and the conflict
that hands it to a person commit together (as on Airlock's own store). An unknown answer is
settled by reading on the next delivery, as for writes; on a target that takes no
idempotency key every delivery reads first, so a redelivered undo is recorded, never resent.
Each send is marked `unknown` on the undo operation before it leaves (cleared by any answer):
a worker killed mid-send leaves the mark, as a lost answer does.

When the attempts run out with such a mark (undo.py `_retry_undo`), the undo is not failed
blind: one last delivery reads the target and sends nothing (`_last_read`): the prior
document under a new version → undone; still the version the write produced → failed, not
done (`last_read: not_applied`); someone else's version → the refusal and a conflict for a
person; unreadable → failed with `outcome: unknown`, `last_read: unsettled` (re-read later by
approvals/services/reread.py, `undo_reread`). A plan's compensation is an undo with an
explicit document (`restore`), so plans compensate external steps the same way.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from approvals.outbox import notify_action_on_commit
from approvals.services.attempts import LAST_READ_DUE, WORKER_ACTOR, crash_point
from audit.services import Actor
from console.tracing import traced
from engine.core.action_audit import audit_action_event
from engine.core.actors import person_id
from engine.core.errors import DomainError
from engine.core.undo import (
    ALREADY_UNDONE,
    NO_PREVIOUS_VERSION,
    NOT_APPLIED,
    RESOURCE_MOVED,
    STALE_FENCE,
    WINDOW_EXPIRED,
    UndoOutcome,
    refuse_undo,
)
from engine.targets.base import (
    ABSENT,
    Applied,
    NotApplied,
    Outcome,
    Snapshot,
    TargetAdapter,
    TargetConfigError,
    TargetError,
    WriteResult,
    settle_by_reading,
)
from ownership.history import revision_at
from ownership.models import Resource
from ownership.services.conflicts import conflict_open_for_undo
from ownership.targets import adapter_for_kind, in_caller_transaction, mirror_snapshot

TARGET_REFUSED = "target_refused"
# An undo ended by its last read without being done (UndoOutcome.reason; undo.py: "failed").
LAST_READ_NOT_APPLIED = "last_read_not_applied"
LAST_READ_UNSETTLED = "last_read_unsettled"
# The mark of a send under way (`outcome.unknown`) until the target answers.
SENDING = "sent; no answer recorded (the worker may have died)"


class TargetNotReady(DomainError):
    """Nothing is known to have happened at the target (not sent, busy, or an answer lost
    that the next delivery settles by reading): deliver the undo again."""

    code = "target_not_ready"
    retryable = True


def external_undo(
    *, undo_op: Operation, action: Action, lock: Any, fence: int, actor: Actor
) -> UndoOutcome:
    original = Operation.objects.get(pk=int(undo_op.undo_of_id or 0))
    base: dict[str, Any] = {
        "operation_id": original.pk,
        "undo_operation_id": undo_op.pk,
        "action_id": action.pk,
        "fence": fence,
        "resource_id": action.resource_id,
        "expected_version": original.result_version,
    }
    deleting_undone = action.operation == "delete"
    refusal = _refusal_before_write(original, undo_op, deleting_undone)
    if refusal is not None:
        return _refused(undo_op, action, actor, refusal, base)
    resource = Resource.objects.filter(kind=action.kind, name=action.name).first()
    restored = _restored(undo_op, original, resource)
    if restored is None:
        message = f"version {original.base_version} was never recorded; it cannot be restored"
        return _refused(undo_op, action, actor, (NO_PREVIOUS_VERSION, message), base)
    adapter = adapter_for_kind(action.kind)
    if undo_last_read_due(undo_op.outcome):  # the attempts ran out: read, never send
        return _last_read(undo_op, action, adapter, original, restored, actor, base)
    # A target that takes no idempotency key is read before anything is sent: a delivery
    # whose worker was killed after the target applied the undo left nothing on record, and
    # a resend would meet the undo's own write as someone else's change (a false conflict).
    # A target that takes one answers a resend with the same key as the first time.
    if (undo_op.outcome or {}).get("unknown") or not adapter.capabilities.takes_idempotency_key:
        settled = _settle(adapter, action, original, restored)
        if isinstance(settled, Applied):
            return _record_undone(
                undo_op, action, original, restored, settled.version, fence, actor
            )
        if not isinstance(settled, NotApplied):
            return _moved(undo_op, action, original, settled.current, actor, base)
    lock.check()
    _mark_sending(undo_op)
    result = _send(adapter, action, original, restored, deleting_undone, fence, undo_op)
    if result.outcome is not Outcome.UNKNOWN:
        _clear_sending(undo_op)
    if result.outcome is Outcome.APPLIED:
        crash_point("external_undo_after_target_applied")  # tests: killed before recording
        return _record_undone(undo_op, action, original, restored, result.version, fence, actor)
    if result.outcome is Outcome.STALE:
        return _moved(undo_op, action, original, result.current, actor, base)
    if result.outcome is Outcome.FENCED:
        return UndoOutcome(applied=False, reason=STALE_FENCE, message=result.detail, **base)
    if result.outcome is Outcome.FAILED:
        return _refused(undo_op, action, actor, (TARGET_REFUSED, result.detail), base)
    if result.outcome is Outcome.UNKNOWN:
        # Kept on the undo (in memory too: the retry rewrites its outcome from this row), so
        # the next delivery settles by reading before it sends anything.
        undo_op.outcome = {**(undo_op.outcome or {}), "unknown": result.detail or "no answer"}
        Operation.objects.filter(pk=undo_op.pk).update(outcome=undo_op.outcome)
    raise TargetNotReady(f"the target did not take the undo yet: {result.outcome}")


def undo_last_read_due(outcome: Any) -> bool:
    """Whether an undo operation's outcome says its last read is due: its next delivery
    reads the target and sends nothing."""
    return isinstance(outcome, dict) and outcome.get("last_read") == LAST_READ_DUE


def undo_last_read_owed(undo_op: Operation) -> bool:
    """Its attempts just ran out: does this undo get a last read before it ends? An undo on an
    external target one of whose sends may have reached it (`unknown`: an answer lost, or a
    worker killed mid-send) does — once."""
    outcome = undo_op.outcome if isinstance(undo_op.outcome, dict) else {}
    if undo_last_read_due(outcome) or not outcome.get("unknown"):
        return False
    return not in_caller_transaction(undo_op.action.kind)


def undo_left_unknown(original_id: int) -> dict[str, Any]:
    """What a new undo of `original_id` (asked again, or a plan's next compensation) inherits
    from an earlier one that ended unsettled: its `unknown` mark, so that the new one reads the
    target before it sends anything (the earlier one may have restored it)."""
    latest = Operation.objects.filter(undo_of_id=original_id).order_by("-started_at").first()
    outcome = latest.outcome if latest is not None else None
    if not isinstance(outcome, dict) or outcome.get("last_read") != "unsettled":
        return {}
    assert latest is not None
    return {"unknown": outcome.get("unknown") or "unsettled", "unknown_from": latest.pk}


def _mark_sending(undo_op: Operation) -> None:
    undo_op.outcome = {**(undo_op.outcome or {}), "unknown": SENDING}
    Operation.objects.filter(pk=undo_op.pk).update(outcome=undo_op.outcome)


def _clear_sending(undo_op: Operation) -> None:
    """The target answered: nothing of this send is unknown (an earlier `unknown` was settled
    by the read before it)."""
    outcome = dict(undo_op.outcome or {})
    outcome.pop("unknown", None)
    undo_op.outcome = outcome
    Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING).update(outcome=outcome)


def _last_read(
    undo_op: Operation,
    action: Action,
    adapter: TargetAdapter,
    original: Operation,
    restored: tuple[Any, bool],
    actor: Actor,
    base: dict[str, Any],
) -> UndoOutcome:
    """The delivery after the attempts ran out with a send that may have reached the target
    (undo.py `_retry_undo`): read, on every target (a replay of the key would be a send), and
    end the undo by what it holds."""
    try:
        settled = _read(adapter, action, original, restored)
    except TargetError as exc:
        unsettled = {"outcome": "unknown", "last_read": "unsettled", "read_error": str(exc)}
        return _end_unread(undo_op, action, LAST_READ_UNSETTLED, unsettled, base)
    if isinstance(settled, Applied):
        return _record_undone(
            undo_op,
            action,
            original,
            restored,
            settled.version,
            base["fence"],
            actor,
            how={"last_read": True},
        )
    if isinstance(settled, NotApplied):
        evidence = {"last_read": "not_applied", "current_version": settled.current.version}
        return _end_unread(undo_op, action, LAST_READ_NOT_APPLIED, evidence, base)
    return _moved(undo_op, action, original, settled.current, actor, base)


def _end_unread(
    undo_op: Operation, action: Action, reason: str, evidence: dict[str, Any], base: dict[str, Any]
) -> UndoOutcome:
    """The last read did not find the undo done: `failed`, retryable (nothing was restored, or
    nothing is known to be), with what the read saw — never a second send."""
    outcome = dict(undo_op.outcome or {})
    if evidence.get("last_read") == "not_applied":
        outcome.pop("unknown", None)  # settled: the target still holds the write's version
    outcome.update(
        evidence,
        reason=str(outcome.get("last_retry_reason") or reason),
        retryable=True,
    )
    with transaction.atomic():
        failed = Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING).update(
            status=OperationStatus.FAILED, outcome=outcome, finished_at=timezone.now()
        )
        if failed:
            audit_action_event(
                action,
                event_type="undo.failed",
                actor=WORKER_ACTOR,
                details={
                    "undo_operation": undo_op.pk,
                    "operation": undo_op.undo_of_id,
                    "reason": outcome["reason"],
                    "attempts": outcome.get("attempts", 0),
                    **evidence,
                },
            )
            notify_action_on_commit(action.pk)
    undo_op.outcome = outcome
    return UndoOutcome(applied=False, reason=reason, message=str(evidence), **base)


def _refusal_before_write(
    original: Operation, undo_op: Operation, deleting_undone: bool
) -> tuple[str, str] | None:
    if original.status == OperationStatus.UNDONE:
        return ALREADY_UNDONE, "already undone"
    if original.status != OperationStatus.DONE or (
        original.result_version is None and not deleting_undone
    ):
        return NOT_APPLIED, "the operation did not write"
    if undo_op.compensation:
        return None
    accepted = undo_op.accepted_at or undo_op.started_at
    if original.undo_deadline is None or accepted >= original.undo_deadline:
        return WINDOW_EXPIRED, "the undo window of this operation has closed"
    return None


def _restored(
    undo_op: Operation, original: Operation, resource: Resource | None
) -> tuple[Any, bool] | None:
    """(document, deleted) the undo puts back; None when that version was never recorded."""
    if isinstance(undo_op.restore, dict):
        return undo_op.restore.get("document") or {}, bool(undo_op.restore.get("deleted"))
    if original.base_version is None:
        return {}, True  # the action created it: the undo deletes it
    row = None if resource is None else revision_at(resource, original.base_version)
    if row is None:
        return None
    return row.document, row.deleted


@traced("airlock.target_call")
def _send(
    adapter: TargetAdapter,
    action: Action,
    original: Operation,
    restored: tuple[Any, bool],
    deleting_undone: bool,
    fence: int,
    undo_op: Operation,
) -> WriteResult:
    document, deleted = restored
    common: dict[str, Any] = {
        "fence": fence,
        "idempotency_key": f"airlock-undo-{undo_op.pk}",
        "message_context": {
            "run": str(action.run_id),
            "action": str(action.pk),
            "approver": f"undo of operation {original.pk}",
        },
    }
    if deleting_undone:
        return adapter.create(action.name, document, **common)
    assert original.result_version is not None
    if deleted:
        return adapter.delete(action.name, expected_version=original.result_version, **common)
    return adapter.write(action.name, document, expected_version=original.result_version, **common)


def _settle(
    adapter: TargetAdapter,
    action: Action,
    original: Operation,
    restored: tuple[Any, bool],
) -> Any:
    try:
        return _read(adapter, action, original, restored)
    except TargetError as exc:
        raise TargetNotReady(f"the target could not be read: {exc}") from None


def _read(
    adapter: TargetAdapter, action: Action, original: Operation, restored: tuple[Any, bool]
) -> Any:
    """The undo settled from what the target holds (TargetError: it could not be read)."""
    document, deleted = restored
    return settle_by_reading(
        adapter,
        action.name,
        written_document=document,
        observed_version=None if action.operation == "delete" else original.result_version,
        deleted=deleted,
    )


def _refused(
    undo_op: Operation, action: Action, actor: Actor, refusal: tuple[str, str], base: dict[str, Any]
) -> UndoOutcome:
    with transaction.atomic():
        return refuse_undo(undo_op, action, actor, *refusal, base)


def _moved(
    undo_op: Operation,
    action: Action,
    original: Operation,
    current: Snapshot | None,
    actor: Actor,
    base: dict[str, Any],
) -> UndoOutcome:
    """Someone changed it since: the refusal and the conflict for a person, together."""
    with transaction.atomic():
        resource = mirror_snapshot(
            action.kind, action.name, current or ABSENT, guard_fence=int(base["fence"])
        )
        if resource is None:
            resource = Resource.objects.get(kind=action.kind, name=action.name)
        base = {**base, "current_version": None if current is None else current.version}
        message = (
            f"the resource moved on to version {base['current_version']} since this write "
            f"produced version {original.result_version}"
        )
        outcome = refuse_undo(undo_op, action, actor, RESOURCE_MOVED, message, base)
        conflict_open_for_undo(
            action=action,
            resource=resource,
            undone_operation=original,
            requested_by=str((undo_op.outcome or {}).get("requested_by") or ""),
            undo_operation=undo_op,
        )
    return outcome


def _record_undone(
    undo_op: Operation,
    action: Action,
    original: Operation,
    restored: tuple[Any, bool],
    version: str | None,
    fence: int,
    actor: Actor,
    how: dict[str, Any] | None = None,
    guard_fence: int | None = None,
) -> UndoOutcome:
    """Record the undo done. `how`: how it was settled when a read settled it after the
    attempts (`last_read`) or after the undo had ended unsettled (`settled_later`) — kept on
    the undo operation and in `write.undone`. `guard_fence`: the lock held while the undo's
    effect was seen, when not the undo's own (`fence`) — the periodic re-read's."""
    how = how or {}
    document, deleted = restored
    now = timezone.now()
    with transaction.atomic():
        resource = mirror_snapshot(
            action.kind,
            action.name,
            ABSENT if deleted else Snapshot(document, version),
            operation="undo",
            fence=fence,
            run_id=action.run_id,
            action_id=action.pk,
            guard_fence=fence if guard_fence is None else guard_fence,
        )
        if resource is not None and person_id(actor) is not None:
            resource.versions.filter(version=resource.version).update(person_id=person_id(actor))
        Operation.objects.filter(pk=original.pk, status=OperationStatus.DONE).update(
            status=OperationStatus.UNDONE
        )
        Operation.objects.filter(pk=undo_op.pk).update(
            status=OperationStatus.DONE,
            fence=fence,
            base_version=original.result_version,
            result_version=version,
            finished_at=now,
            outcome={"result": "undone", "restored_version": original.base_version, **how},
        )
        Action.objects.filter(pk=action.pk).update(
            status=ActionStatus.UNDONE, revision=F("revision") + 1, updated_at=now
        )
        audit_action_event(
            action,
            event_type="write.undone",
            actor=actor,
            details={
                "target": action.kind.target,
                "operation_id": original.pk,
                "undo_operation_id": undo_op.pk,
                "fence": fence,
                "from_version": original.result_version,
                "to_version": version,
                "restored_version": original.base_version,
                **how,
            },
        )
    return UndoOutcome(
        applied=True,
        operation_id=original.pk,
        undo_operation_id=undo_op.pk,
        action_id=action.pk,
        fence=fence,
        resource_id=action.resource_id,
        expected_version=original.result_version,
        restored_version=original.base_version,
        result_version=version,
    )


def undo_reread(undo_op: Operation, *, actor: Actor, lock: Any) -> str:
    """The periodic re-read of an undo that ended unsettled (approvals/services/reread.py),
    under the resource's `lock` (checked after the read, before the record: LockLost):
    "applied" (the prior document under a new version: recorded undone now), "not_applied"
    (the write's version: not done, said on the undo), "conflict" (someone else's version,
    said on the undo), "unreadable" (unchanged) or "superseded" (settled meanwhile)."""
    action = undo_op.action
    original = Operation.objects.get(pk=int(undo_op.undo_of_id or 0))
    resource = Resource.objects.filter(kind=action.kind, name=action.name).first()
    restored = _restored(undo_op, original, resource)
    if restored is None:
        return "unreadable"
    try:
        settled = _read(adapter_for_kind(action.kind), action, original, restored)
    except (TargetError, TargetConfigError):
        return "unreadable"
    lock.check()  # still ours: nothing was written since the read
    now = timezone.now()
    with transaction.atomic():
        locked = (
            Operation.objects.select_for_update()
            .filter(pk=undo_op.pk, status=OperationStatus.FAILED, outcome__last_read="unsettled")
            .first()
        )
        if locked is None or (
            Operation.objects.filter(undo_of=original, started_at__gt=locked.started_at).exists()
        ):
            return "superseded"
        outcome = dict(locked.outcome or {})
        reread = {**(outcome.get("reread") or {}), "at": now.isoformat()}
        if isinstance(settled, Applied):
            reread["result"] = "applied"
            how = {"settled_later": True, "unknown": outcome.get("unknown"), "reread": reread}
            _record_undone(
                locked,
                action,
                original,
                restored,
                settled.version,
                locked.fence,
                actor,
                how,
                guard_fence=int(lock.fence),
            )
            return "applied"
        result = "not_applied" if isinstance(settled, NotApplied) else "conflict"
        evidence = {
            "last_read": result,
            "current_version": settled.current.version if settled.current else None,
            "settled_later": now.isoformat(),
        }
        if result == "not_applied":
            outcome.pop("unknown", None)
            outcome.pop("outcome", None)
        if settled.current is not None:
            mirror_snapshot(action.kind, action.name, settled.current, guard_fence=int(lock.fence))
        Operation.objects.filter(pk=locked.pk).update(
            outcome={**outcome, **evidence, "reread": {**reread, "result": result}}
        )
        audit_action_event(
            action,
            event_type="undo.reread",
            actor=actor,
            details={
                "undo_operation": locked.pk,
                "operation": original.pk,
                "result": result,
                **evidence,
            },
        )
        notify_action_on_commit(action.pk)
    return result
