"""Undo of an applied action: request (API/pages) and execution (job).

`action_undo_request` records the one live undo operation of the action's
applied operation (however many requests, one undo; a partial unique constraint
on `undo_of`) and enqueues its job on commit. The job takes the resource lock and
a fresh fence and calls the core's `apply_undo`; if someone wrote since, the undo
becomes a conflict for a person (origin `undo`) instead of restoring an old snapshot.

An accepted undo is never lost:
- a kill switch covering the resource pauses it (`paused_reason`, still
  `pending`, no attempt spent); releasing the switch resumes paused undos in
  order (console.services.kill_switch_set), and the reconciler resumes any whose
  switch is gone and resends pending ones whose job Redis lost;
- a busy lock (another writer holds the resource) is waited out, never counted
  as a failed attempt;
- the undo window is judged at acceptance (`accepted_at`), not at execution;
- an undo that failed for a retryable reason (attempts exhausted on transient
  errors) may be asked for again: a new undo operation, under the same rules;
- an external undo whose attempts run out after a send that may have reached the target
  is read once more before it ends (external_undo `_last_read`), never failed blind; one
  that ended unsettled hands its `unknown` mark to the next undo asked for, which reads
  before it sends.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

import redis
from django.db import DatabaseError, transaction
from django.db.models import Exists, OuterRef, QuerySet
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus, RunStatus
from approvals.outbox import engine_redis, enqueue_undo_execution, notify_action_on_commit
from approvals.services.attempts import (
    backoff_seconds,
    crash_point,
    lock_ttl_ms,
    max_attempts,
    operation_lease_seconds,
    worker_name,
)
from approvals.services.external_undo import (
    LAST_READ_NOT_APPLIED,
    LAST_READ_UNSETTLED,
    external_undo,
    undo_last_read_due,
    undo_last_read_owed,
    undo_left_unknown,
)
from approvals.services.runs import RunNotActive, run_require_own_active, run_status_for_share
from approvals.services.worker_presence import acquire_taking_over
from audit.models import ActorType
from audit.services import Actor
from console.permissions import can_undo_as_person, require_person
from console.requestctx import log_action, log_fence
from console.tracing import traced
from engine.core.action_audit import audit_action_event
from engine.core.errors import (
    Forbidden,
    InvalidTransition,
    KillSwitchEngaged,
    LockBusy,
    NotFound,
    UndoWindowExpired,
)
from engine.core.fence import next_fence
from engine.core.killswitch import engaged_switch_for, hold_switches_shared
from engine.core.lock import FencedLock
from engine.core.operations import applied_operation, open_operation
from engine.core.undo import RESOURCE_MOVED, STALE_FENCE, UndoOutcome, apply_undo
from ownership.models import Resource
from ownership.services.conflicts import conflict_open_for_undo
from ownership.targets import adapter_for_kind, in_caller_transaction

log = logging.getLogger("airlock.undo")


def action_undo_authorise(*, action_id: uuid.UUID | str, actor: Actor) -> Action:
    """Who may undo the action, in the contract's order: NotFound (no such action, or
    another run's), Forbidden, RunNotActive. Returns the action.

    A run undoes its own actions while it is active, never a person's conflict
    resolution; a person needs the operator role or the resource's owner group.
    The API calls it before it reads the Idempotency-Key (an unauthorised caller
    never learns about the key); `action_undo_request` calls it first too.
    """
    try:
        action_uuid = uuid.UUID(str(action_id))
    except ValueError as exc:
        raise NotFound("No such action.") from exc
    action = Action.objects.select_related("kind", "resource", "run").filter(pk=action_uuid).first()
    if action is None:
        raise NotFound("No such action.")
    if actor.type == ActorType.RUN:
        if actor.id != str(action.run_id):
            raise NotFound("No such action.")  # another run's: it may not learn it exists
        if action.parent_id is not None:
            raise Forbidden(
                "This action is a person's conflict resolution; the run's token cannot undo it.",
                code="forbidden",
            )
        run_require_own_active(actor=actor, run_id=action.run_id)
        return action
    if actor.type != ActorType.PERSON:
        raise Forbidden("Only the action's run or a person may undo.", code="forbidden")
    owner_group = action.resource.owner_group if action.resource else action.kind.owner_group
    require_person(
        actor,
        lambda person: can_undo_as_person(person, owner_group=owner_group),
        "Undo needs the operator role or membership of the resource's owner group.",
    )
    return action


def _require_active_run(run_id: uuid.UUID) -> None:
    """A run token undoes only while its run is active (a revoked run's token is no
    credential for production changes). FOR SHARE on the run: a revoke committing
    first is seen, one arriving later waits for us."""
    if run_status_for_share(run_id) != RunStatus.ACTIVE:
        raise RunNotActive(
            f"Run {run_id} is not active; only an active run's token may undo.",
            extra={"run": str(run_id)},
        )


UNDO_REASON_MAX = 500  # as Airlock-Reason on a write


@traced("airlock.undo.request")
def action_undo_request(
    *, action_id: uuid.UUID | str, actor: Actor, idempotency_key: str = "", reason: str = ""
) -> Operation:
    """Ask for the undo of an applied action; returns its (single) undo operation.

    `actor`: the action's run, or a person with the operator role or in the
    resource's owner group. Raises NotFound, Forbidden, RunNotActive,
    UndoWindowExpired (409
    `undo_window_expired`), InvalidTransition (409: nothing applied to undo).
    Repeating the request returns the same undo operation, with no new audit row.
    `reason`: the requester's own words (optional, at most UNDO_REASON_MAX characters;
    callers validate), kept on the undo operation and in `undo.requested`'s details, so
    a conflict it opens shows the requester's reason, never the agent's.
    """
    reason = reason.strip()[:UNDO_REASON_MAX]
    action = action_undo_authorise(action_id=action_id, actor=actor)
    with transaction.atomic():
        if actor.type == ActorType.RUN:
            _require_active_run(action.run_id)
        locked = Action.objects.select_for_update(of=("self",)).get(pk=action.pk)
        original = _applied_operation(locked)
        latest = Operation.objects.filter(undo_of=original).order_by("-started_at").first()
        if latest is not None and not _may_ask_again(latest):
            return latest
        accepted_at = timezone.now()
        if original.undo_deadline is None or accepted_at >= original.undo_deadline:
            raise UndoWindowExpired(
                "The undo window of this action has closed.",
                extra={"undo_deadline": original.undo_deadline},
            )
        inherited = undo_left_unknown(original.pk)  # before this undo is the newest
        undo_op = open_operation(
            action_id=locked.pk,
            fence=next_fence(),
            worker="undo-request",
            lease_seconds=0,
            undo_of_id=original.pk,
        )
        Operation.objects.filter(pk=undo_op.pk).update(
            lease_expires_at=None,
            accepted_at=accepted_at,
            outcome={
                "requested_by": actor.label,
                "requested_by_type": actor.type,
                "requested_by_person": actor.id if actor.type == ActorType.PERSON else "",
                "idempotency_key": idempotency_key[:255],
                "requested_reason": reason,
                **inherited,
            },
        )
        audit_action_event(
            locked,
            event_type="undo.requested",
            actor=actor,
            details={
                "operation": original.pk,
                "undo_operation": undo_op.pk,
                "asked_again_after": latest.pk if latest is not None else None,
                **({"reason": reason} if reason else {}),
            },
        )
        undo_id = undo_op.pk
        transaction.on_commit(lambda: enqueue_undo_execution(undo_id))
    undo_op.refresh_from_db()
    return undo_op


def _applied_operation(action: Action) -> Operation:
    """The applied write an undo restores; InvalidTransition when there is none."""
    original = applied_operation(action.pk)
    if original is None:
        raise InvalidTransition(
            f"The action is {action.status}; there is no applied write to undo.",
            code="invalid_transition",
        )
    return original


def _requested_by(undo_op: Operation, action: Action) -> Actor:
    """Who asked for the undo, as recorded at acceptance (the run re-read for a run)."""
    requested = dict(undo_op.outcome or {})
    actor = Actor(
        type=str(requested.get("requested_by_type") or ActorType.SYSTEM),
        id=str(requested.get("requested_by_person") or ""),
        label=str(requested.get("requested_by") or "undo"),
    )
    return Actor.run(action.run) if actor.type == ActorType.RUN else actor


def _may_ask_again(undo_op: Operation) -> bool:
    """An undo that failed for a retryable reason may be asked for again."""
    outcome = undo_op.outcome if isinstance(undo_op.outcome, dict) else {}
    return undo_op.status == OperationStatus.FAILED and bool(outcome.get("retryable"))


def _retry_undo(
    undo_op: Operation,
    reason: str,
    connection: redis.Redis | None,
    *,
    count_attempt: bool = True,
) -> str:
    """Schedule the next delivery with backoff, or fail (retryable) once attempts run out.

    `count_attempt=False` (a busy lock: another writer holds the resource) waits
    without spending the budget; its backoff grows with the waits, capped.
    """
    outcome = dict(undo_op.outcome or {})
    if count_attempt:
        attempts = int(outcome.get("attempts", 0)) + 1
        outcome["attempts"] = attempts
        step = attempts
    else:
        attempts = int(outcome.get("attempts", 0))
        waits = int(outcome.get("lock_waits", 0)) + 1
        outcome["lock_waits"] = waits
        step = waits
    outcome["last_retry_reason"] = reason
    if count_attempt and attempts >= max_attempts():
        if undo_last_read_owed(undo_op):
            return _schedule_last_read(undo_op, outcome, reason, attempts, connection)
        # The last read was due and could not be made (its delivery failed): unknown.
        unsettled = (
            {"outcome": "unknown", "last_read": "unsettled"}
            if undo_last_read_due(undo_op.outcome)
            else {}
        )
        outcome.update(unsettled, reason=reason)
        # Transient causes only reach here: the person may ask for the undo again.
        outcome["retryable"] = True
        with transaction.atomic():
            failed = Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING).update(
                status=OperationStatus.FAILED, outcome=outcome, finished_at=timezone.now()
            )
            if failed:
                _audit_undo_event(
                    "undo.failed", undo_op, {"reason": reason, "attempts": attempts, **unsettled}
                )
                notify_action_on_commit(undo_op.action_id)
        return "failed"
    Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING).update(
        outcome=outcome, lease_expires_at=None
    )
    enqueue_undo_execution(undo_op.pk, delay_seconds=backoff_seconds(step), connection=connection)
    return "retry"


def _schedule_last_read(
    undo_op: Operation,
    outcome: dict[str, Any],
    reason: str,
    attempts: int,
    connection: redis.Redis | None,
) -> str:
    """The attempts ran out after a send that may have reached the target: one more delivery,
    after a backoff, that only reads it (external_undo `_last_read`) — `last_read: due`."""
    delay = backoff_seconds(attempts)
    outcome["last_read"] = "due"
    with transaction.atomic():
        moved = Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING).update(
            outcome=outcome, lease_expires_at=None
        )
        if moved:
            _audit_undo_event(
                "undo.last_read_scheduled",
                undo_op,
                {"reason": reason, "attempts": attempts, "delay_seconds": round(delay, 3)},
            )
    undo_op.outcome = outcome
    if moved:
        enqueue_undo_execution(undo_op.pk, delay_seconds=delay, connection=connection)
    return "last_read"


def _audit_undo_event(event_type: str, undo_op: Operation, details: dict[str, Any]) -> None:
    action = undo_op.action
    audit_action_event(
        action,
        event_type=event_type,
        actor=Actor.system("worker"),
        details={"undo_operation": undo_op.pk, "operation": undo_op.undo_of_id, **details},
    )


def _pause_undo(undo_op: Operation, connection: redis.Redis | None) -> str:
    """A kill switch covers the resource: hold the undo (no attempt spent) until a
    release resumes it.

    Under the kill-switch lock held shared (an engage/release takes it exclusively):
    either a release committed first and we see no switch (deliver again now), or
    our pause commits first and the release finds the paused undo and resumes it.
    """

    identifier = undo_op.action.resource_identifier
    with transaction.atomic():
        hold_switches_shared()
        switch = engaged_switch_for(identifier)
        if switch is not None:
            paused = Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING).update(
                paused_reason=switch.reason or f"kill switch {switch.scope}",
                lease_expires_at=None,
            )
            if paused and not undo_op.paused_reason:
                _audit_undo_event(
                    "undo.paused", undo_op, {"reason": switch.reason, "scope": switch.scope}
                )
                notify_action_on_commit(undo_op.action_id)
    if switch is None:
        enqueue_undo_execution(undo_op.pk, connection=connection)
        return "retry"
    return "paused"


@traced("airlock.undo")
def undo_execute(*, undo_operation_id: int, connection: redis.Redis | None = None) -> str:
    """The undo job: lock, fresh fence, apply_undo; a moved resource opens a conflict.

    A kill switch pauses the undo, a busy lock is waited out; neither spends an
    attempt. Idempotent: anything but a pending undo is a no-op.
    """
    undo_op = (
        Operation.objects.select_related("undo_of", "action__kind", "action__conflict_class")
        .filter(pk=undo_operation_id, undo_of__isnull=False)
        .first()
    )
    if undo_op is None or undo_op.status != OperationStatus.PENDING:
        return "skipped"
    action = undo_op.action  # with its kind and class (refresh_from_db drops the cache)
    log_action(action)  # its run and resource on the job's log lines
    if engaged_switch_for(action.resource_identifier) is not None:
        return _pause_undo(undo_op, connection)
    if undo_op.paused_reason:
        # Delivered after its switch was released (a release or the reconciler resumed it).
        Operation.objects.filter(pk=undo_op.pk).update(paused_reason="")
        undo_op.paused_reason = ""
    lock = FencedLock(
        connection or engine_redis(),
        key=action.resource_identifier,
        ttl_ms=lock_ttl_ms(),
        holder=worker_name(),
    )
    try:
        fence = acquire_taking_over(lock, wait_seconds=0.2)  # a gone worker's lock is freed
        log_fence(fence)
    except LockBusy:
        return _retry_undo(undo_op, "lock_busy", connection, count_attempt=False)
    except (redis.RedisError, DatabaseError) as exc:
        return _retry_undo(undo_op, type(exc).__name__, connection)
    try:
        lock.start_heartbeat()
        if not _claim_delivery(undo_op, fence):
            return "skipped"
        return _apply_under_lock(undo_op, action, lock, fence, connection)
    finally:
        try:
            lock.release()
        except redis.RedisError:
            log.warning("could not release the lock on %s", action.resource_identifier)


def _claim_delivery(undo_op: Operation, fence: int) -> bool:
    """Stamp this delivery's fence and lease on the undo operation (a newer fence
    only); False when the undo is no longer pending."""
    Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING, fence__lt=fence).update(
        fence=fence,
        worker=worker_name()[:200],
        lease_expires_at=timezone.now() + timedelta(seconds=operation_lease_seconds()),
    )
    undo_op.refresh_from_db()
    return undo_op.status == OperationStatus.PENDING


def _apply_under_lock(
    undo_op: Operation,
    action: Action,
    lock: FencedLock,
    fence: int,
    connection: redis.Redis | None,
) -> str:
    """apply_undo under the held lock; a switch engaged meanwhile pauses the undo,
    a lost lock or a transient error schedules another delivery."""
    try:
        lock.check()
        # By what the kind's adapter can do: one that writes in this transaction restores
        # under the barrier's rules (engine/core/undo.py); any other is one call away.
        if not in_caller_transaction(action.kind):
            outcome = external_undo(
                undo_op=undo_op,
                action=action,
                lock=lock,
                fence=fence,
                actor=_requested_by(undo_op, action),
            )
            return _settle(undo_op, action, outcome, connection)
        # The refusal of an undo whose resource moved and the conflict that hands it to a
        # person commit together: a worker killed in between leaves the undo pending
        # (delivered again), never failed with nobody asked.
        with transaction.atomic():
            outcome = apply_undo(
                operation_id=undo_op.undo_of_id,  # type: ignore[arg-type]
                undo_operation_id=undo_op.pk,
                fence=fence,
                actor=_requested_by(undo_op, action),
                target=adapter_for_kind(action.kind),
            )
            crash_point("inside_undo_before_commit")
            if outcome.reason == RESOURCE_MOVED:
                crash_point("undo_refused_before_conflict")
                _open_undo_conflict(undo_op, action)
    except KillSwitchEngaged:
        return _pause_undo(undo_op, connection)
    except Exception as exc:  # lock lost, transient database/redis errors
        if isinstance(exc, (redis.RedisError, DatabaseError)) or getattr(exc, "retryable", False):
            return _retry_undo(undo_op, type(exc).__name__, connection)
        raise
    return _settle(undo_op, action, outcome, connection)


def _settle(
    undo_op: Operation, action: Action, outcome: UndoOutcome, connection: redis.Redis | None
) -> str:
    """What the barrier's answer means for the job: done, another delivery (a newer
    fence won), a conflict for a person (someone wrote since), or refused."""
    if outcome.applied:
        with transaction.atomic():
            notify_action_on_commit(action.pk)
        return "undone"
    if outcome.reason == STALE_FENCE:
        return _retry_undo(undo_op, STALE_FENCE, connection)
    if outcome.reason == RESOURCE_MOVED:
        return "conflict"  # opened with the refusal, in its transaction
    if outcome.reason in (LAST_READ_NOT_APPLIED, LAST_READ_UNSETTLED):
        return "failed"  # the last read ended it (external_undo._end_unread)
    return f"refused:{outcome.reason}"


def _open_undo_conflict(undo_op: Operation, action: Action) -> None:
    """The conflict of an undo that found a later write, inside the refusal's transaction
    (base = the version the action produced, current = now, proposed = the restore)."""
    conflict_open_for_undo(
        action=action,
        resource=Resource.objects.get(pk=int(action.resource_id or 0)),
        undone_operation=Operation.objects.get(pk=int(undo_op.undo_of_id or 0)),
        requested_by=str((undo_op.outcome or {}).get("requested_by") or ""),
        undo_operation=undo_op,
    )


def operations_open_to_undo() -> QuerySet[Operation]:
    """Applied writes an undo may still be asked for (pages offer the button on these):
    done, no live undo, and any failed undo failed for a retryable reason. The
    deadline is the caller's filter."""
    undos = Operation.objects.filter(undo_of=OuterRef("pk"))
    failed = undos.filter(status=OperationStatus.FAILED)
    return (
        Operation.objects.filter(status=OperationStatus.DONE, undo_of__isnull=True)
        .exclude(Exists(undos.exclude(status=OperationStatus.FAILED)))
        .exclude(Exists(failed) & ~Exists(failed.filter(outcome__retryable=True)))
    )


def undo_status(action: Action) -> dict[str, Any] | None:
    """The undo state of an action for API/pages: None when never requested."""
    undo_op = (
        Operation.objects.filter(action=action, undo_of__isnull=False)
        .order_by("-started_at")
        .first()
    )
    if undo_op is None:
        return None
    conflict = action.conflicts.filter(origin="undo").first()
    outcome = undo_op.outcome if isinstance(undo_op.outcome, dict) else {}
    return {
        "operation": undo_op.pk,
        "status": undo_op.status,
        "paused_reason": undo_op.paused_reason,
        "accepted_at": undo_op.accepted_at.isoformat() if undo_op.accepted_at else None,
        "may_ask_again": _may_ask_again(undo_op),
        "requested_by": outcome.get("requested_by", ""),
        "conflict_id": str(conflict.pk) if conflict else None,
        "action_status": ActionStatus(action.status).value,
    }
