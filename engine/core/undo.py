"""Undo through the same barrier.

`apply_undo` restores the document from before `operation_id` (or the tombstone, for a
create; or revives the resource, for a delete) through the kind's adapter (`restore`, in
this transaction: an adapter whose capabilities say `in_caller_transaction`; Airlock's own
store writes one conditional UPDATE) — only while the target is at the version the
operation produced and has seen no newer fence — when
the undo was accepted inside the operation's undo deadline (`accepted_at`). One live undo
per operation (a partial unique constraint on `undo_of`) and the undo operation moves
pending -> done/failed exactly once under a row lock, so asking again (or twice at the same time)
answers "already_undone" and writes nothing.

Refusal reasons: "window_expired", "resource_moved" (the caller opens a conflict — inside
the same transaction: it calls apply_undo in its own atomic block, so the refusal and the
conflict commit together or not at all),
"already_undone", "not_applied" (the operation never wrote), "stale_fence" (a newer
lock holder wrote first: take a new fence and ask again), "no_previous_version" (the
resource was seeded without a ResourceVersion row for the version to restore).
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from audit.services import Actor
from engine.core.action_audit import audit_action_event
from engine.core.actors import person_id
from engine.core.errors import NotFound
from engine.core.killswitch import hold_switches_shared, refuse_if_engaged
from engine.core.kind_targets import adapter_for_kind
from engine.targets.base import Outcome, TargetAdapter
from ownership.models import ResourceVersion

WINDOW_EXPIRED = "window_expired"
RESOURCE_MOVED = "resource_moved"
ALREADY_UNDONE = "already_undone"
NOT_APPLIED = "not_applied"
STALE_FENCE = "stale_fence"
NO_PREVIOUS_VERSION = "no_previous_version"


@dataclass(frozen=True)
class UndoOutcome:
    applied: bool
    operation_id: int
    undo_operation_id: int
    action_id: uuid.UUID
    fence: int
    reason: str | None = None
    message: str = ""
    resource_id: int | None = None
    # The version the undo needed (the operation's result) and the one it found.
    expected_version: str | None = None
    current_version: str | None = None
    # On success: the version the undo restored and the new version it wrote.
    restored_version: str | None = None
    result_version: str | None = None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["action_id"] = str(self.action_id)
        return data


def apply_undo(
    *,
    operation_id: int,
    undo_operation_id: int,
    fence: int,
    actor: Actor,
    target: TargetAdapter | None = None,
) -> UndoOutcome:
    """Undo one applied operation, in one transaction.

    Locks the undo operation, then the original operation, then the action (the
    same order as apply_action), re-checks the kill switch (raises
    KillSwitchEngaged: nothing written, the undo operation stays pending),
    then writes through `target` (default: the action's kind's adapter), which must write
    in this transaction. Raises NotFound for an unknown pair of operations.
    """
    with transaction.atomic():
        # Before any row lock: an engage waits for this undo, or this undo sees it.
        hold_switches_shared()
        undo_op = (
            Operation.objects.select_for_update()
            .filter(pk=undo_operation_id, undo_of_id=operation_id)
            .first()
        )
        if undo_op is None:
            raise NotFound(
                "no such undo operation",
                extra={"operation": operation_id, "undo_operation": undo_operation_id},
            )
        original = Operation.objects.select_for_update().get(pk=operation_id)
        action = (
            Action.objects.select_for_update(of=("self",))
            .select_related("kind", "run")
            .get(pk=original.action_id)
        )
        base: dict[str, Any] = {
            "operation_id": original.pk,
            "undo_operation_id": undo_op.pk,
            "action_id": action.pk,
            "fence": fence,
            "resource_id": action.resource_id,
            "expected_version": original.result_version,
        }
        if undo_op.status != OperationStatus.PENDING:
            return _answer_again(undo_op, base)
        refusal = _refusal_before_write(original, undo_op)
        if refusal is not None:
            return refuse_undo(undo_op, action, actor, *refusal, base)

        refuse_if_engaged(action.resource_identifier)

        resource_id = action.resource_id
        assert resource_id is not None  # set by apply_action on every accepted write
        restored = _restored_state(resource_id, original, undo_op)
        if restored is None:
            # A resource seeded without its history row: nothing to restore from.
            message = f"version {original.base_version} was never recorded; it cannot be restored"
            return refuse_undo(undo_op, action, actor, NO_PREVIOUS_VERSION, message, base)
        if target is None:
            target = adapter_for_kind(action.kind)
        written = _write_restored(target, action, original, restored, fence=fence, base=base)
        if isinstance(written, tuple):
            return refuse_undo(undo_op, action, actor, *written, base)
        return _record_undone(
            action,
            original,
            undo_op,
            restored,
            new_version=written,
            resource_id=resource_id,
            fence=fence,
            actor=actor,
        )


def _answer_again(undo_op: Operation, base: dict[str, Any]) -> UndoOutcome:
    """Asked again after it finished: answer from the record, write nothing."""
    if undo_op.status == OperationStatus.DONE:
        return UndoOutcome(
            applied=False,
            reason=ALREADY_UNDONE,
            message="this operation has already been undone",
            **base,
        )
    recorded = undo_op.outcome or {}
    return UndoOutcome(
        applied=False,
        reason=str(recorded.get("reason") or ALREADY_UNDONE),
        message=str(recorded.get("message") or "the undo has already been attempted"),
        **base,
    )


def _refusal_before_write(original: Operation, undo_op: Operation) -> tuple[str, str] | None:
    """(reason, message) when the operation cannot be undone at all, else None."""
    if original.status == OperationStatus.UNDONE:
        return ALREADY_UNDONE, "already undone"
    if original.status != OperationStatus.DONE or original.result_version is None:
        return NOT_APPLIED, "the operation did not write"
    # The window is judged when the undo was accepted (202), not when a worker
    # got to it: a kill switch or a busy lock may hold an accepted undo past it.
    if undo_op.compensation:
        return None  # a plan's compensation is part of the plan, not an undo window's
    accepted = undo_op.accepted_at or undo_op.started_at
    if original.undo_deadline is None or accepted >= original.undo_deadline:
        return WINDOW_EXPIRED, "the undo window of this operation has closed"
    return None


def _restored_state(
    resource_id: int, original: Operation, undo_op: Operation
) -> tuple[Any, bool] | None:
    """(document, deleted) from before the operation — or a plan's explicit
    compensation (`undo_op.restore`); None when it was never recorded."""
    if isinstance(undo_op.restore, dict):
        return undo_op.restore.get("document") or {}, bool(undo_op.restore.get("deleted"))
    if original.base_version is None:
        # The operation created the resource: undo leaves a tombstone.
        return {}, True
    previous = ResourceVersion.objects.filter(
        resource_id=resource_id, version=int(original.base_version)
    ).first()
    if previous is None:
        return None
    return previous.document, previous.deleted


def _write_restored(
    target: TargetAdapter,
    action: Action,
    original: Operation,
    restored: tuple[Any, bool],
    *,
    fence: int,
    base: dict[str, Any],
) -> str | tuple[str, str]:
    """The restore through the adapter: the version it wrote, or (reason, message) on a miss
    (and `current_version` noted in `base`)."""
    assert target.capabilities.in_caller_transaction  # its write commits with the records
    expected = original.result_version
    assert expected is not None  # checked by _refusal_before_write
    document, deleted = restored
    # Any state at the version the operation produced (a tombstone too: the undo of a
    # delete revives it).
    result = target.restore(
        action.name,
        document,
        deleted=deleted,
        on_version=expected,
        fence=fence,
        idempotency_key=f"airlock-undo-{original.pk}",
    )
    if result.applied:
        assert result.version is not None  # this store counts a tombstone's version too
        return result.version
    held = result.held
    assert held is not None  # an adapter in the caller's transaction says where it stands
    base["current_version"] = held.version
    if result.outcome is Outcome.FENCED:
        return (STALE_FENCE, f"fence {fence} is stale: fence {held.fence} has already written")
    return (
        RESOURCE_MOVED,
        f"the resource moved on to version {held.version} since this write "
        f"produced version {expected}",
    )


def _record_undone(
    action: Action,
    original: Operation,
    undo_op: Operation,
    restored: tuple[Any, bool],
    *,
    new_version: str,
    resource_id: int,
    fence: int,
    actor: Actor,
) -> UndoOutcome:
    """The undo wrote `new_version`: its history row, both operations settled, the action
    undone, and the audit event last."""
    now = timezone.now()
    document, deleted = restored
    ResourceVersion.objects.create(
        resource_id=resource_id,
        version=int(new_version),
        document=document,
        deleted=deleted,
        operation="undo",
        fence=fence,
        run_id=action.run_id,
        action_id=action.pk,
        person_id=person_id(actor),
    )
    Operation.objects.filter(pk=original.pk, status=OperationStatus.DONE).update(
        status=OperationStatus.UNDONE
    )
    Operation.objects.filter(pk=undo_op.pk).update(
        status=OperationStatus.DONE,
        fence=fence,
        base_version=original.result_version,
        result_version=new_version,
        finished_at=now,
        outcome={"result": "undone", "restored_version": original.base_version},
    )
    Action.objects.filter(pk=action.pk).update(
        status=ActionStatus.UNDONE, revision=F("revision") + 1, updated_at=now
    )
    audit_action_event(
        action,
        event_type="write.undone",
        actor=actor,
        details={
            "operation_id": original.pk,
            "undo_operation_id": undo_op.pk,
            "fence": fence,
            "from_version": original.result_version,
            "to_version": new_version,
            "restored_version": original.base_version,
        },
    )
    return UndoOutcome(
        applied=True,
        operation_id=original.pk,
        undo_operation_id=undo_op.pk,
        action_id=action.pk,
        fence=fence,
        resource_id=resource_id,
        expected_version=original.result_version,
        restored_version=original.base_version,
        result_version=new_version,
    )


def refuse_undo(
    undo_op: Operation,
    action: Action,
    actor: Actor,
    reason: str,
    message: str,
    base: dict[str, Any],
) -> UndoOutcome:
    outcome = UndoOutcome(applied=False, reason=reason, message=message, **base)
    recorded = outcome.as_dict()
    if reason != STALE_FENCE:
        Operation.objects.filter(pk=undo_op.pk).update(
            status=OperationStatus.FAILED, outcome=recorded, finished_at=timezone.now()
        )
    # A stale fence leaves the undo pending: this holder was overtaken, and the
    # retry with a fresh fence must still be able to finish the one undo.
    audit_action_event(
        action,
        event_type="write.undo_refused",
        actor=actor,
        details={k: v for k, v in recorded.items() if k != "action_id"},
    )
    return outcome
