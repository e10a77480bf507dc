"""One delivery's bookkeeping: claim, pause, retry with backoff, fail, route a refusal.

Shared by the write job (approvals.services.execution, .external_writes), the undo
job and the reconciler. Every state change goes through
action_status.action_transition (a conditional UPDATE) inside a short transaction
with its audit event; a stale attempt (abandoned by the reconciler, or
superseded by a newer one) records nothing.

Attempts that run out end the action `failed` — except a write to an external target one
of whose attempts may have reached it (its answer lost, its worker killed): "failed" would
put on record that the target does not hold a write it may hold (and leave it without an
undo). That write gets one last read first (`schedule_last_read`; the delivery that reads
is external_writes._last_read), and is ended by what the read shows.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection as db_connection
from django.db import transaction
from django.utils import timezone

from approvals.models import (
    IN_FLIGHT_STATUSES,
    Action,
    ActionStatus,
    Operation,
    OperationStatus,
    maybe_reached_target,
)
from approvals.notify import notify_action_changed
from approvals.outbox import enqueue_action_execution, notify_action_on_commit
from approvals.services.action_status import action_transition
from approvals.services.worker_presence import worker_name as presence_worker_name
from audit.services import Actor
from engine.core.action_audit import audit_action_event
from engine.core.errors import DomainError
from engine.core.killswitch import engaged_switch_for
from engine.core.operations import open_operation
from engine.core.row_locks import operation_locked
from ownership.services.conflicts import conflict_open_for_action

log = logging.getLogger("airlock.execution")

WORKER_ACTOR = Actor.system("worker")

# `error.last_read` of an action queued for its last read (schedule_last_read).
LAST_READ_DUE = "due"


def crash_point(name: str) -> None:
    """TEST HOOK: SIGKILL this process at a named point when settings.AIRLOCK_TEST_CRASH_AT
    names it. A no-op while that setting is empty (never set in production)."""
    if name == settings.AIRLOCK_TEST_CRASH_AT:
        log.warning("AIRLOCK_TEST_CRASH_AT=%s: killing worker process %s", name, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


def notify_action_changed_now(action_id: uuid.UUID) -> None:
    """Wake long-pollers after a transition the core committed on its own (outside a
    transaction: publish at once, without opening an empty one to hang the hook on)."""
    if db_connection.in_atomic_block:
        notify_action_on_commit(action_id)
    else:
        notify_action_changed(action_id)


def worker_name() -> str:
    """The name this process stamps on the work it holds (worker_presence: the Procfile's
    worker publishes its presence under it, so that work it dies holding is resumed)."""
    return presence_worker_name()


def lock_ttl_ms() -> int:
    return int(settings.AIRLOCK_LOCK_TTL_MS)


def operation_lease_seconds() -> int:
    """An operation's lease outlives the lock by a margin: after that a holder's
    fence can only be refused, so the reconciler may re-run the action."""
    return max(2, math.ceil(lock_ttl_ms() / 1000) + 2)


def max_attempts() -> int:
    return int(settings.AIRLOCK_MAX_ATTEMPTS)


def backoff_seconds(attempt: int) -> float:
    """Exponential backoff with full jitter, capped."""
    base = float(settings.AIRLOCK_BACKOFF_BASE_SECONDS)
    ceiling = min(float(settings.AIRLOCK_BACKOFF_CAP_SECONDS), base * (2 ** max(attempt - 1, 0)))
    return max(0.05, random.uniform(ceiling / 2, ceiling))


def enqueue_on_commit(action_id: uuid.UUID, delay_seconds: float = 0.0) -> None:
    transaction.on_commit(lambda: enqueue_action_execution(action_id, delay_seconds=delay_seconds))


def audit_worker_event(event_type: str, action: Action, details: dict[str, Any]) -> None:
    """An event about `action` by the worker, inside the caller's transaction."""
    audit_action_event(
        action,
        event_type=event_type,
        actor=WORKER_ACTOR,
        details=details,
    )


def operation_fail_pending(operation_id: int, outcome: dict[str, Any]) -> int:
    """Close an attempt's operation as failed, only while it is still pending."""
    return Operation.objects.filter(pk=operation_id, status=OperationStatus.PENDING).update(
        status=OperationStatus.FAILED, finished_at=timezone.now(), outcome=outcome
    )


def renew_operation_lease(operation_id: int) -> None:
    """Extend a pending operation's lease (called from the lock's heartbeat thread,
    which has its own database connection: closed again at once)."""
    try:
        Operation.objects.filter(pk=operation_id, status=OperationStatus.PENDING).update(
            lease_expires_at=timezone.now() + timedelta(seconds=operation_lease_seconds())
        )
    finally:
        db_connection.close()


def attempt_superseded(operation_id: int) -> bool:
    """Inside a transaction: lock this attempt's operation (before the action: the
    barrier's and the reconciler's order) and say whether the attempt is stale —
    the reconciler abandoned it (lease expired) or a newer attempt exists. A stale
    worker that resumes must then record nothing and move nothing."""
    operation = operation_locked(operation_id)
    if operation is None:
        return True
    if isinstance(operation.outcome, dict) and operation.outcome.get("abandoned"):
        return True
    return Operation.objects.filter(
        action_id=operation.action_id, undo_of__isnull=True, pk__gt=operation.pk
    ).exists()


def claim(action: Action, fence: int) -> Operation | str:
    """Open this attempt's operation (the action becomes `executing`) — only from
    `queued`, checked by the claim's own conditional UPDATE under the lock, so a
    duplicate delivery that waited for the lock stops here — or return the outcome
    `skipped:<status>` when the action moved on since it was read."""
    try:
        operation = open_operation(
            action_id=action.pk,
            fence=fence,
            worker=worker_name(),
            lease_seconds=operation_lease_seconds(),
            from_statuses=(ActionStatus.QUEUED,),
        )
    except DomainError as exc:
        log.info("action %s not claimed: %s", action.pk, exc)
        return f"skipped:{exc.extra.get('status', 'missing')}"
    notify_action_changed_now(action.pk)  # now `executing`
    return operation


def action_pause(*, action_id: uuid.UUID, reason: str, scope: str = "") -> bool:
    """queued -> paused with the kill switch's reason (audited)."""
    with transaction.atomic():
        moved = action_transition(
            action_id=action_id,
            from_statuses=IN_FLIGHT_STATUSES,
            to_status=ActionStatus.PAUSED,
            paused_reason=reason,
        )
        if moved:
            action = Action.objects.get(pk=action_id)
            audit_worker_event("action.paused", action, {"reason": reason, "scope": scope})
    return moved


def action_retry_later(
    *,
    action_id: uuid.UUID,
    reason: str,
    from_statuses: tuple[str, ...] = IN_FLIGHT_STATUSES,
    count_attempt: bool = True,
    operation_id: int | None = None,
) -> str:
    """Back to `queued` with a backoff delay, or `failed` once attempts run out (or
    `queued` for a last read first: schedule_last_read).

    Closes the attempt's pending operation (if any) as failed first. Returns the
    new status ("queued" / "failed" / "" when the action had moved on).
    """
    with transaction.atomic():
        if operation_id is not None and attempt_superseded(operation_id):
            return ""
        action = (
            Action.objects.select_for_update(of=("self",))
            .filter(pk=action_id, status__in=from_statuses)
            .first()
        )
        if action is None:
            return ""
        if operation_id is not None:
            operation_fail_pending(operation_id, {"refused": reason, "retry": True})
        attempts = action.attempts + (1 if count_attempt else 0)
        # A busy lock means someone else is writing the resource, not that this
        # write is failing: allow it a much longer wait before giving up.
        limit = max_attempts() * 4 if reason == "lock_busy" else max_attempts()
        if attempts >= limit:
            error = {"code": "attempts_exhausted", "reason": reason, "attempts": attempts}
            if last_read_owed(action):
                schedule_last_read(
                    action, from_statuses=from_statuses, attempts=attempts, error=error
                )
                return ActionStatus.QUEUED
            unsettled = unsettled_outcome(action)
            action_transition(
                action_id=action_id,
                from_statuses=from_statuses,
                to_status=ActionStatus.FAILED,
                attempts=attempts,
                error={**error, **unsettled},
            )
            audit_worker_event(
                "action.failed", action, {"reason": reason, "attempts": attempts, **unsettled}
            )
            return ActionStatus.FAILED
        delay = backoff_seconds(attempts or 1)
        action_transition(
            action_id=action_id,
            from_statuses=from_statuses,
            to_status=ActionStatus.QUEUED,
            attempts=attempts,
            not_before=timezone.now() + timedelta(seconds=delay),
        )
        audit_worker_event(
            "action.retry_scheduled",
            action,
            {"reason": reason, "attempt": attempts, "delay_seconds": round(delay, 3)},
        )
        enqueue_on_commit(action_id, delay)
    return ActionStatus.QUEUED


def last_read_due(error: Any) -> bool:
    """Whether an action's `error` says its last read is due (schedule_last_read): its
    next delivery reads the target and sends nothing."""
    return isinstance(error, dict) and error.get("last_read") == LAST_READ_DUE


def last_read_owed(action: Action) -> bool:
    """Inside a transaction, `action` locked, its attempts just run out: does it get a last
    read before it ends? A write to an external target with an attempt that may have
    reached it (approvals.models.maybe_reached_target) does — once: a delivery that was
    itself the last read ends the action."""
    if last_read_due(action.error):
        return False
    return Action.objects.filter(pk=action.pk).filter(maybe_reached_target()).exists()


def schedule_last_read(
    action: Action,
    *,
    from_statuses: tuple[str, ...],
    attempts: int,
    error: dict[str, Any],
    actor: Actor = WORKER_ACTOR,
) -> None:
    """Inside the caller's transaction (`action` locked; last_read_owed said yes): back to
    `queued` once more, marked in `error` (the exhaustion's code and reason, and
    `last_read: due`), for a delivery that only reads the target
    (external_writes._last_read). After a backoff, as any attempt: the answer lost a moment
    ago may belong to a write the target is still carrying out."""
    delay = backoff_seconds(attempts or 1)
    action_transition(
        action_id=action.pk,
        from_statuses=from_statuses,
        to_status=ActionStatus.QUEUED,
        attempts=attempts,
        not_before=timezone.now() + timedelta(seconds=delay),
        error={**error, "last_read": LAST_READ_DUE},
    )
    audit_action_event(
        action,
        event_type="action.last_read_scheduled",
        actor=actor,
        details={**error, "delay_seconds": round(delay, 3)},
    )
    enqueue_on_commit(action.pk, delay)


def unsettled_outcome(action: Action) -> dict[str, str]:
    """What an action ending `failed` says of its write when its last read was due and
    decided nothing (the target could not be read, or the read could not be made): the
    outcome is unknown — the target may hold it. Empty for any other failure."""
    if last_read_due(action.error):
        return {"outcome": "unknown", "last_read": "unsettled"}
    return {}


def action_fail(
    *, action_id: uuid.UUID, code: str, reason: str, operation_id: int | None = None
) -> bool:
    with transaction.atomic():
        if operation_id is not None:
            if attempt_superseded(operation_id):
                return False
            operation_fail_pending(operation_id, {"error": code, "reason": reason})
        moved = action_transition(
            action_id=action_id,
            from_statuses=IN_FLIGHT_STATUSES,
            to_status=ActionStatus.FAILED,
            error={"code": code, "reason": reason},
        )
        if moved:
            action = Action.objects.get(pk=action_id)
            audit_worker_event("action.failed", action, {"code": code, "reason": reason})
    return moved


def route_refusal(*, action_id: uuid.UUID, operation_id: int | None, refusal: str) -> str:
    """What happens to an action whose write the barrier (or a target) refused."""
    if refusal == "run_not_active":
        # The barrier already ended the action (cancelled / expired) in its transaction.
        return "run_not_active"
    if refusal in ("stale_version", "missing", "already_exists"):
        conflict_open_for_action(action_id=action_id, operation_id=operation_id, refusal=refusal)
        return "conflict"
    if refusal in ("kill_switch", "kill_switch_engaged"):
        action = Action.objects.get(pk=action_id)
        switch = engaged_switch_for(action.resource_identifier)
        reason = switch.reason if switch is not None else "kill switch engaged"
        if operation_id is not None:
            operation_fail_pending(operation_id, {"refused": refusal})
        action_pause(action_id=action_id, reason=reason, scope=switch.scope if switch else "")
        return "paused"
    if refusal in ("operation_not_pending", "action_not_executable"):
        # This delivery was superseded (the reconciler took the operation back,
        # or the action moved on): whoever superseded it carries on.
        return "superseded"
    if refusal in ("stale_fence", "lock_lost"):
        action_retry_later(
            action_id=action_id,
            reason=refusal,
            operation_id=operation_id,
            from_statuses=(ActionStatus.EXECUTING,),
        )
        return "retry"
    action_fail(
        action_id=action_id, code=refusal or "refused", reason=refusal, operation_id=operation_id
    )
    return "failed"
