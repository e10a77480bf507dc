"""One attempt of a write against a kind's external target, through its adapter
(engine/targets: an HTTP service with ETags, PostgreSQL rows, a git repository).

An external target has no barrier transaction: the run and the kill switch are re-checked
right before sending (a revoke or an engage that commits while the request is in flight
cannot recall it), and the target's own conditional write is the precondition — on the
version token the agent observed, compared exactly by the target.

An attempt whose outcome is unknown leaves the operation `unknown` (sent, no answer) or
`failed` with `abandoned` (its worker killed while holding it: the reconciler closes it and
queues the action again). The next attempt settles either before anything else:
- a target that honours our Idempotency-Key gets the same write again with the same key,
  and answers what it did the first time;
- any other target is read (`engine.targets.base.settle_by_reading`): our document under a
  new version → applied, once; still the version we wrote on → not applied, send again;
  anything else → someone else changed it: a conflict routed by class. Never a second blind
  attempt.
When the attempts run out with such an attempt unsettled, the action is not ended `failed`
blind: one last delivery reads the target the same way and sends nothing (`_last_read`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    ApprovalDecision,
    Operation,
    OperationStatus,
    unsettled_attempt,
)
from approvals.services.action_status import action_transition
from approvals.services.attempts import (
    WORKER_ACTOR,
    action_fail,
    action_pause,
    action_retry_later,
    attempt_superseded,
    audit_worker_event,
    claim,
    crash_point,
    last_read_due,
    operation_fail_pending,
    renew_operation_lease,
    route_refusal,
)
from console.tracing import traced
from engine.core.barrier import refuse_if_run_ended
from engine.core.errors import LockLost
from engine.core.killswitch import engaged_switch_for
from engine.core.land import undo_window
from engine.core.row_locks import action_locked, operation_locked
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
from ownership.diff import proposed_document
from ownership.history import document_at, revision_at
from ownership.models import Resource
from ownership.targets import adapter_for_kind, mirror_snapshot

log = logging.getLogger("airlock.execution")


def _idempotency_key_for(action_id: Any) -> str:
    """The same key for every attempt of one action (sent only to targets that honour it)."""
    return f"airlock-action-{action_id}"


@dataclass(frozen=True)
class Intended:
    """What this action writes at the target: the whole document, or a deletion."""

    document: Any
    deleted: bool


def execute_external(*, action: Action, lock: Any, fence: int) -> str:
    """One attempt against the kind's target; returns a short outcome."""
    operation = claim(action, fence)
    if isinstance(operation, str):
        return operation
    if refuse_if_run_ended(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
    ):
        return "run_not_active"
    switch = engaged_switch_for(action.resource_identifier)
    if switch is not None:
        operation_fail_pending(operation.pk, {"refused": "kill_switch_engaged"})
        action_pause(action_id=action.pk, reason=switch.reason, scope=switch.scope)
        return "paused"
    try:
        adapter = adapter_for_kind(action.kind)
    except TargetConfigError as exc:
        action_fail(
            action_id=action.pk,
            code="target_misconfigured",
            reason=str(exc),
            operation_id=operation.pk,
        )
        return "failed"
    # The call may outlast the operation's lease (lock TTL + 2 s): renew the lease with the
    # lock, so the reconciler never abandons a request still in flight.
    lock.on_renew(partial(renew_operation_lease, operation.pk))
    intended = intended_write(action, adapter)
    if isinstance(intended, Snapshot):  # the version moved before we could even build it
        return _record_stale(action=action, operation=operation, current=intended, fence=fence)
    if last_read_due(action.error):  # the attempts ran out: read, never send
        return _last_read(action, operation, adapter, intended, fence)
    if not adapter.capabilities.takes_idempotency_key and _earlier_unknown(action):
        settled = _settle_by_reading(action, operation, adapter, intended, fence)
        if not isinstance(settled, NotApplied):
            return settled
        # Not applied: the earlier attempts never reached the target. Closed as such, they
        # no longer keep the action alive past its run's end — which is checked again.
        _close_not_applied(action, operation)
        if refuse_if_run_ended(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
        ):
            return "run_not_active"
    result = _send(
        action=action,
        operation=operation,
        lock=lock,
        fence=fence,
        adapter=adapter,
        intended=intended,
    )
    if isinstance(result, str):
        return result
    if result.outcome is Outcome.APPLIED:
        crash_point("external_after_target_applied")  # tests: killed before recording it
    return _route(action, operation, adapter, intended, fence, result)


def intended_write(action: Action, adapter: TargetAdapter) -> Intended | Snapshot:
    """The document this write puts at the target. A merge patch applies to the document the
    agent observed (the mirror's revision at that token; read from the target when the
    mirror never saw it). A Snapshot: the target is no longer at the observed version."""
    if action.operation == "delete":
        return Intended({}, True)
    if action.payload_format != "merge_patch":
        return Intended(proposed_document(action, {}), False)
    resource = Resource.objects.filter(kind=action.kind, name=action.name).first()
    if resource is not None and (
        resource.token == action.observed_version
        or revision_at(resource, action.observed_version) is not None
    ):
        base = document_at(resource, action.observed_version)
        return Intended(proposed_document(action, base), False)
    try:
        current = adapter.read(action.name)
    except TargetError:
        current = ABSENT
    if current.version != action.observed_version:
        return current
    return Intended(proposed_document(action, current.document), False)


def _earlier_unknown(action: Action) -> bool:
    """Whether an earlier attempt may have reached the target: its answer was lost
    (`unknown`), or its worker died holding it (abandoned by the reconciler — killed after
    the target applied, the write is there and nothing recorded it). Either is settled by
    reading before anything is sent: a second send would meet our own write as a stale
    version and report a false conflict."""
    return Operation.objects.filter(unsettled_attempt(), action=action).exists()


def _close_not_applied(action: Action, operation: Operation) -> None:
    """The earlier attempts that may have reached the target, found by reading not to
    have: failed, `settled: not_applied` (an abandoned one keeps that it was, under
    another name: `abandoned` marks an attempt still to settle)."""
    earlier = Operation.objects.filter(unsettled_attempt(), action=action).exclude(pk=operation.pk)
    now = timezone.now()
    for row in earlier.only("pk", "outcome"):
        before = dict(row.outcome) if isinstance(row.outcome, dict) else {}
        was_abandoned = bool(before.pop("abandoned", False))
        Operation.objects.filter(pk=row.pk).update(
            status=OperationStatus.FAILED,
            finished_at=now,
            outcome={
                **before,
                "was_abandoned": was_abandoned,
                "settled": "not_applied",
                "by": "reading",
            },
        )


def _settle_by_reading(
    action: Action,
    operation: Operation,
    adapter: TargetAdapter,
    intended: Intended,
    fence: int,
    *,
    last_read: bool = False,
) -> str | NotApplied:
    """An earlier attempt's unknown outcome, settled from what the target holds: the
    attempt's short outcome, or NotApplied (with what the target holds) — the write did not
    happen, the caller decides what follows (send it again; or, the last read, end it)."""
    try:
        settled = settle_by_reading(
            adapter,
            action.name,
            written_document=intended.document,
            observed_version=action.observed_version,
            deleted=intended.deleted,
        )
    except TargetError as exc:
        # Nothing settled. The last read's own delivery ends here: action_retry_later finds
        # its attempts spent and the last read made, and records the outcome as unknown.
        status = action_retry_later(
            action_id=action.pk, reason=f"target_unreadable: {exc}", operation_id=operation.pk
        )
        return "failed" if status == ActionStatus.FAILED else "retry"
    if isinstance(settled, NotApplied):
        return settled
    if isinstance(settled, Applied):
        return _record_applied(
            action=action,
            operation=operation,
            fence=fence,
            version=settled.version,
            intended=intended,
            settled_by_reading=True,
            last_read=last_read,
        )
    return _record_stale(action=action, operation=operation, current=settled.current, fence=fence)


def _last_read(
    action: Action, operation: Operation, adapter: TargetAdapter, intended: Intended, fence: int
) -> str:
    """The delivery after the attempts ran out with one that may have reached the target
    (attempts.schedule_last_read): the target is read as the next attempt would read it —
    on every target, also one that takes an Idempotency-Key (a replay would be a send) —
    and nothing is sent. Ours → applied; someone else's → a conflict, as the next attempt
    would route it; the version we wrote on → failed, with what the read saw; unreadable →
    failed, the outcome unknown (_settle_by_reading)."""
    settled = _settle_by_reading(action, operation, adapter, intended, fence, last_read=True)
    if isinstance(settled, NotApplied):
        return _fail_not_applied(action, operation, settled.current)
    return settled


def _fail_not_applied(action: Action, operation: Operation, current: Snapshot) -> str:
    """The last read found the target still at the version we wrote on: no attempt reached
    it. The earlier attempts close as not applied (_close_not_applied), and the action ends
    `failed` — its error and audit event keep why the attempts ran out and say what the read
    saw, the evidence for "not applied"."""
    evidence = {"last_read": "not_applied", "current_version": current.version}
    with transaction.atomic():
        if attempt_superseded(operation.pk):
            return "superseded"
        locked = (
            Action.objects.select_for_update(of=("self",))
            .filter(pk=action.pk, status=ActionStatus.EXECUTING)
            .first()
        )
        if locked is None:
            return "superseded"
        _close_not_applied(locked, operation)
        operation_fail_pending(operation.pk, evidence)
        exhausted = dict(locked.error) if isinstance(locked.error, dict) else {}
        action_transition(
            action_id=action.pk,
            from_statuses=(ActionStatus.EXECUTING,),
            to_status=ActionStatus.FAILED,
            error={**exhausted, **evidence},
        )
        audit_worker_event(
            "action.failed",
            locked,
            {
                "reason": exhausted.get("reason", exhausted.get("code", "")),
                "attempts": locked.attempts,
                **evidence,
            },
        )
    return "failed"


def _message_context(action: Action) -> dict[str, str]:
    approvers = ApprovalDecision.objects.filter(
        approval__action_id=action.pk, decision="approve"
    ).values_list("person__username", flat=True)
    return {
        "run": str(action.run_id),
        "action": str(action.pk),
        "approver": ", ".join(sorted(approvers)) or "auto-approved",
    }


@traced("airlock.target_call")
def _send(
    *,
    action: Action,
    operation: Operation,
    lock: Any,
    fence: int,
    adapter: TargetAdapter,
    intended: Intended,
) -> WriteResult | str:
    """The target's answer, or the attempt's short outcome when the lock was lost."""
    try:
        lock.check()
    except LockLost:
        action_retry_later(action_id=action.pk, reason="lock_lost", operation_id=operation.pk)
        return "lock_lost"
    common: dict[str, Any] = {
        "fence": fence,
        "idempotency_key": _idempotency_key_for(action.pk),
        "message_context": _message_context(action),
    }
    if action.operation == "create":
        return adapter.create(action.name, intended.document, **common)
    observed = action.observed_version
    assert observed is not None  # a constraint: updates and deletes observe a version
    if intended.deleted:
        return adapter.delete(action.name, expected_version=observed, **common)
    return adapter.write(action.name, intended.document, expected_version=observed, **common)


def _route(
    action: Action,
    operation: Operation,
    adapter: TargetAdapter,
    intended: Intended,
    fence: int,
    result: WriteResult,
) -> str:
    outcome = result.outcome
    if outcome is Outcome.APPLIED:
        version = result.version
        if version is None and not intended.deleted:
            version = _read_back_version(adapter, action.name, intended.document)
        return _record_applied(
            action=action, operation=operation, fence=fence, version=version, intended=intended
        )
    if outcome is Outcome.STALE:
        current = result.current
        if current is None:
            try:
                current = adapter.read(action.name)
            except TargetError:
                current = None
        if current is not None and not current.exists and action.operation != "create":
            _mirror_quietly(action, ABSENT, fence)
            action_fail(
                action_id=action.pk,
                code="not_found",
                reason=f"{action.resource_identifier} is gone at the target",
                operation_id=operation.pk,
            )
            return "failed"
        return _record_stale(action=action, operation=operation, current=current, fence=fence)
    if outcome is Outcome.UNKNOWN:
        return _record_unknown(action, operation, fence, result.detail)
    if outcome is Outcome.FAILED:
        action_fail(
            action_id=action.pk,
            code="target_refused",
            reason=result.detail or "the target refused the write",
            operation_id=operation.pk,
        )
        return "failed"
    # not_sent, locked, fenced: nothing happened at the target; another attempt (a newer
    # fence, after a backoff) may succeed. Attempts are counted: a target that stays down
    # ends `failed`, never a false `applied`.
    reason = {
        Outcome.NOT_SENT: "target_unreachable",
        Outcome.LOCKED: "target_busy",
        Outcome.FENCED: "stale_fence",
    }[outcome]
    action_retry_later(
        action_id=action.pk,
        reason=f"{reason}: {result.detail}" if result.detail else reason,
        operation_id=operation.pk,
    )
    return "retry"


def _read_back_version(adapter: TargetAdapter, name: str, document: Any) -> str | None:
    """The target applied but named no version: take the one it now holds for our document."""
    try:
        current = adapter.read(name)
    except TargetError:
        return None
    return current.version if current.exists and current.document == document else None


def _record_unknown(action: Action, operation: Operation, fence: int, detail: str) -> str:
    """Sent, no answer: the operation is `unknown` until the next attempt settles it."""
    with transaction.atomic():
        if attempt_superseded(operation.pk):
            return "superseded"
        Operation.objects.filter(pk=operation.pk, status=OperationStatus.PENDING).update(
            status=OperationStatus.UNKNOWN, outcome={"unknown": detail}
        )
        audit_worker_event(
            "write.unknown",
            action,
            {"operation_id": operation.pk, "fence": fence, "error": detail},
        )
    action_retry_later(
        action_id=action.pk, reason="target_timeout_after_send", operation_id=operation.pk
    )
    return "unknown"


def _record_applied(
    *,
    action: Action,
    operation: Operation,
    fence: int,
    version: str | None,
    intended: Intended,
    settled_by_reading: bool = False,
    last_read: bool = False,
) -> str:
    # The last read's settlement is said so in the operation and the audit event.
    by_last_read = {"last_read": True} if last_read else {}
    now = timezone.now()
    with transaction.atomic():
        # Lock this attempt's operation, then the action (the barrier's and the reconciler's
        # order). A worker that was paused past its lease resumes here after the reconciler
        # closed its operation and another delivery may already have recorded the effect:
        # it records nothing but closing its own operation (conditionally), so one effect
        # is recorded once.
        mine = operation_locked(operation.pk)
        locked = action_locked(action.pk)
        if (
            mine is None
            or mine.status != OperationStatus.PENDING
            or locked.status != ActionStatus.EXECUTING
        ):
            operation_fail_pending(operation.pk, {"superseded": True})
            log.info("action %s: stale delivery of operation %s", action.pk, operation.pk)
            return "superseded"
        resource = mirror_written(action, intended, version, fence=fence, guard_fence=fence)
        effect_op = _settle_unknown(action=action, operation=operation)
        settled = operation_record_applied(
            effect_op.pk,
            action=action,
            version=version,
            now=now,
            from_statuses=(OperationStatus.PENDING, OperationStatus.UNKNOWN),
            outcome={
                "settled_by": operation.pk if effect_op.pk != operation.pk else None,
                "settled_by_reading": settled_by_reading,
                **by_last_read,
            },
        )
        if not settled:  # cannot happen under the locks above; never record twice
            return "superseded"
        moved = action_transition(
            action_id=action.pk,
            from_statuses=(ActionStatus.EXECUTING,),
            to_status=ActionStatus.APPLIED,
            error=None,
            resource=resource,
        )
        assert moved  # the action row is locked and was `executing`
        audit_worker_event(
            "write.applied",
            action,
            {
                "target": action.kind.target,
                "operation_id": effect_op.pk,
                "fence": fence,
                "from_version": action.observed_version,
                "to_version": version,
                "settled_by_reading": settled_by_reading,
                **by_last_read,
            },
        )
    return "applied"


def mirror_written(
    action: Action, intended: Intended, version: str | None, *, fence: int, guard_fence: int
) -> Resource | None:
    """The mirror row after our write took effect at the target (its history row with it);
    the row as it is when the mirror keeps nothing new — or when a holder of a fence newer
    than `guard_fence` (the lock held while our write's effect was seen) recorded since."""
    snapshot = ABSENT if intended.deleted else Snapshot(intended.document, version)
    resource = None
    if snapshot.exists or intended.deleted:  # a write reported with no version: no mirror
        resource = mirror_snapshot(
            action.kind,
            action.name,
            snapshot,
            operation=action.operation,
            fence=fence,
            run_id=action.run_id,
            action_id=action.pk,
            guard_fence=guard_fence,
        )
    if resource is None:
        resource = Resource.objects.filter(kind=action.kind, name=action.name).first()
    return resource


def operation_record_applied(
    operation_id: int,
    *,
    action: Action,
    version: str | None,
    now: datetime,
    outcome: dict[str, Any],
    from_statuses: tuple[str, ...] | None = None,
) -> int:
    """The operation that carried the effect `done`: the versions, the undo deadline counted
    from `now`, and its outcome (`applied` on this target, with `outcome`'s details). Only
    from `from_statuses` when given; the rows updated (0 or 1)."""
    rows = Operation.objects.filter(pk=operation_id)
    if from_statuses is not None:
        rows = rows.filter(status__in=from_statuses)
    return rows.update(
        status=OperationStatus.DONE,
        base_version=action.observed_version,
        result_version=version,
        finished_at=now,
        undo_deadline=now + undo_window(action),
        outcome={"result": "applied", "target": action.kind.target, **outcome},
    )


def _settle_unknown(*, action: Action, operation: Operation) -> Operation:
    """The operation that made the effect: an earlier `unknown` attempt made it (a replay
    or a read settles it), and this attempt's own operation closes as failed."""
    unknown = (
        Operation.objects.select_for_update()
        .filter(action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN)
        .order_by("started_at")
        .first()
    )
    if unknown is None:
        return operation
    now = timezone.now()
    operation_fail_pending(operation.pk, {"settles": unknown.pk})
    Operation.objects.filter(
        action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN
    ).exclude(pk=unknown.pk).update(status=OperationStatus.FAILED, finished_at=now)
    return unknown


def _mirror_quietly(action: Action, snapshot: Snapshot | None, fence: int) -> None:
    """What the target answered, read under the lock of `fence` (a newer holder's record
    is kept: ownership.targets.mirror_snapshot)."""
    if snapshot is None:
        return
    mirror_snapshot(action.kind, action.name, snapshot, guard_fence=fence)


def _record_stale(
    *, action: Action, operation: Operation, current: Snapshot | None, fence: int
) -> str:
    """The version moved at the target: mirror what it holds (for the conflict page), close
    any unknown attempt (it did not apply ours), then route by class."""
    with transaction.atomic():
        if attempt_superseded(operation.pk):
            return "superseded"
        _mirror_quietly(action, current, fence)
        Operation.objects.filter(
            action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN
        ).update(
            status=OperationStatus.FAILED,
            finished_at=timezone.now(),
            outcome={"settled": "not_applied", "by": "reading"},
        )
        audit_worker_event(
            "write.refused",
            action,
            {
                "target": action.kind.target,
                "reason": "stale_version",
                "current_version": None if current is None else current.version,
                "operation_id": operation.pk,
            },
        )
    return route_refusal(action_id=action.pk, operation_id=operation.pk, refusal="stale_version")
