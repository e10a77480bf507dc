"""Executing approved actions: the job body, retries, the outbox reconciler.

Flow of one delivery (`action_execute`):
  1. load the action; anything but `queued` is a no-op (re-delivery, duplicates);
  2. kill switch engaged for the resource -> `paused` with the reason;
  3. take the resource's FencedLock (busy -> retry later with backoff, stays `queued`);
  4. re-check the status now that the lock is held; `open_operation` moves it to
     `executing` with a lease; `apply_action` writes through the barrier in one
     transaction;
  5. a refusal is routed: stale version -> conflict (ownership.services), kill
     switch -> paused, stale fence / lost lock -> queued again with a new fence
     on the next attempt; transient errors -> exponential backoff with jitter,
     at most AIRLOCK_MAX_ATTEMPTS, then `failed` with the reason.

PostgreSQL is the outbox: `reconcile()` re-enqueues due actions whose job is
missing from RQ and recovers operations a dead worker left `pending` past
their lease.
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import uuid
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import redis
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db import connection as db_connection
from django.db.models import Q
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from approvals.outbox import (
    engine_redis,
    enqueue_action_execution,
    enqueue_undo_execution,
    job_is_pending,
    notify_action_on_commit,
)
from approvals.services.decisions import action_transition
from audit.services import Actor, audit_append
from console.core.errors import DomainError, KillSwitchEngaged, LockBusy, LockLost
from console.requestctx import reset_request_id, set_request_id
from ownership.models import TargetType

log = logging.getLogger("airlock.execution")

MAX_ATTEMPTS = int(getattr(settings, "AIRLOCK_MAX_ATTEMPTS", 8))
BACKOFF_BASE_SECONDS = float(getattr(settings, "AIRLOCK_BACKOFF_BASE_SECONDS", 0.5))
BACKOFF_CAP_SECONDS = float(getattr(settings, "AIRLOCK_BACKOFF_CAP_SECONDS", 30.0))
# How long after its last transition a queued action may lack a job before the
# reconciler resends it (covers the gap between commit and on_commit enqueue).
OUTBOX_GRACE_SECONDS = 2.0
# A retry still only *scheduled* this long after it was due is stuck (no worker
# runs RQ's scheduler): the reconciler enqueues it directly.
SCHEDULED_OVERDUE_SECONDS = 30.0
WORKER_ACTOR = Actor.system("worker")


# -- test hook ----------------------------------------------------------------------


def crash_point(name: str) -> None:
    """TEST HOOK: SIGKILL this process at a named point when AIRLOCK_TEST_CRASH_AT
    names it. A no-op unless that environment variable is set (never in production)."""
    wanted = os.environ.get("AIRLOCK_TEST_CRASH_AT")
    if wanted and wanted == name:
        log.warning("AIRLOCK_TEST_CRASH_AT=%s: killing worker process %s", name, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


# -- helpers ------------------------------------------------------------------------


def notify_action_changed_now(action_id: uuid.UUID) -> None:
    """Wake long-pollers after a transition the core committed on its own."""
    with transaction.atomic():
        notify_action_on_commit(action_id)


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def lock_ttl_ms() -> int:
    return int(settings.AIRLOCK_LOCK_TTL_MS)


def operation_lease_seconds() -> int:
    """An operation's lease outlives the lock by a margin: after that a holder's
    fence can only be refused, so the reconciler may re-run the action."""
    return max(2, math.ceil(lock_ttl_ms() / 1000) + 2)


def backoff_seconds(attempt: int) -> float:
    """Exponential backoff with full jitter, capped."""
    ceiling = min(BACKOFF_CAP_SECONDS, BACKOFF_BASE_SECONDS * (2 ** max(attempt - 1, 0)))
    return max(0.05, random.uniform(ceiling / 2, ceiling))


def _refusal_code(outcome: Any) -> str:
    refusal = getattr(outcome, "refusal", None)
    if refusal is None:
        return ""
    if isinstance(refusal, str):
        return refusal
    for attr in ("code", "reason", "kind"):
        value = getattr(refusal, attr, None)
        if isinstance(value, str):
            return value
    if isinstance(refusal, dict):
        return str(refusal.get("code") or refusal.get("reason") or "")
    return str(refusal)


def _enqueue_on_commit(action_id: uuid.UUID, delay_seconds: float = 0.0) -> None:

    transaction.on_commit(lambda: enqueue_action_execution(action_id, delay_seconds=delay_seconds))


def _audit_worker_event(event_type: str, action: Action, details: dict[str, Any]) -> None:
    """An event about `action` by the worker, inside the caller's transaction."""
    audit_append(
        event_type=event_type,
        actor=WORKER_ACTOR,
        resource=action.resource_identifier,
        run_id=action.run_id,
        action_id=action.pk,
        details=details,
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
    operation = Operation.objects.select_for_update().filter(pk=operation_id).first()
    if operation is None:
        return True
    if isinstance(operation.outcome, dict) and operation.outcome.get("abandoned"):
        return True
    return Operation.objects.filter(
        action_id=operation.action_id, undo_of__isnull=True, pk__gt=operation.pk
    ).exists()


def action_pause(*, action_id: uuid.UUID, reason: str, scope: str = "") -> bool:
    """queued -> paused with the kill switch's reason (audited)."""
    with transaction.atomic():
        moved = action_transition(
            action_id=action_id,
            from_statuses=(ActionStatus.QUEUED, ActionStatus.EXECUTING),
            to_status=ActionStatus.PAUSED,
            paused_reason=reason,
        )
        if moved:
            action = Action.objects.get(pk=action_id)
            _audit_worker_event("action.paused", action, {"reason": reason, "scope": scope})
    return moved


def action_retry_later(
    *,
    action_id: uuid.UUID,
    reason: str,
    from_statuses: tuple[str, ...] = (ActionStatus.QUEUED, ActionStatus.EXECUTING),
    count_attempt: bool = True,
    operation_id: int | None = None,
) -> str:
    """Back to `queued` with a backoff delay, or `failed` once attempts run out.

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
            Operation.objects.filter(pk=operation_id, status=OperationStatus.PENDING).update(
                status=OperationStatus.FAILED,
                finished_at=timezone.now(),
                outcome={"refused": reason, "retry": True},
            )
        attempts = action.attempts + (1 if count_attempt else 0)
        # A busy lock means someone else is writing the resource, not that this
        # write is failing: allow it a much longer wait before giving up.
        limit = MAX_ATTEMPTS * 4 if reason == "lock_busy" else MAX_ATTEMPTS
        if attempts >= limit:
            action_transition(
                action_id=action_id,
                from_statuses=from_statuses,
                to_status=ActionStatus.FAILED,
                attempts=attempts,
                error={"code": "attempts_exhausted", "reason": reason, "attempts": attempts},
            )
            _audit_worker_event("action.failed", action, {"reason": reason, "attempts": attempts})
            return ActionStatus.FAILED
        delay = backoff_seconds(attempts or 1)
        action_transition(
            action_id=action_id,
            from_statuses=from_statuses,
            to_status=ActionStatus.QUEUED,
            attempts=attempts,
            not_before=timezone.now() + timedelta(seconds=delay),
        )
        _audit_worker_event(
            "action.retry_scheduled",
            action,
            {"reason": reason, "attempt": attempts, "delay_seconds": round(delay, 3)},
        )
        _enqueue_on_commit(action_id, delay)
    return ActionStatus.QUEUED


def action_fail(
    *, action_id: uuid.UUID, code: str, reason: str, operation_id: int | None = None
) -> bool:
    with transaction.atomic():
        if operation_id is not None:
            if attempt_superseded(operation_id):
                return False
            Operation.objects.filter(pk=operation_id, status=OperationStatus.PENDING).update(
                status=OperationStatus.FAILED,
                finished_at=timezone.now(),
                outcome={"error": code, "reason": reason},
            )
        moved = action_transition(
            action_id=action_id,
            from_statuses=(ActionStatus.QUEUED, ActionStatus.EXECUTING),
            to_status=ActionStatus.FAILED,
            error={"code": code, "reason": reason},
        )
        if moved:
            action = Action.objects.get(pk=action_id)
            _audit_worker_event("action.failed", action, {"code": code, "reason": reason})
    return moved


# -- the job body -------------------------------------------------------------------


def action_execute(*, action_id: uuid.UUID, connection: redis.Redis | None = None) -> str:
    """Execute one delivery of an action's job. Idempotent; returns a short outcome."""
    action = (
        Action.objects.select_related("kind", "conflict_class", "run").filter(pk=action_id).first()
    )
    if action is None:
        return "missing"
    token = set_request_id(action.request_id or f"action-{action.pk}")
    try:
        return _execute(action, connection=connection)
    finally:
        reset_request_id(token)


def _execute(action: Action, *, connection: redis.Redis | None) -> str:
    from console.core.killswitch import engaged_switch_for
    from console.core.lock import FencedLock

    if action.status != ActionStatus.QUEUED:
        return f"skipped:{action.status}"
    now = timezone.now()
    if action.not_before and action.not_before > now + timedelta(milliseconds=50):
        # An early duplicate delivery: honour the backoff.

        enqueue_action_execution(
            action.pk,
            delay_seconds=(action.not_before - now).total_seconds(),
            connection=connection,
        )
        return "deferred"
    switch = engaged_switch_for(action.resource_identifier)
    if switch is not None:
        action_pause(action_id=action.pk, reason=switch.reason, scope=switch.scope)
        return "paused"

    if connection is None:
        connection = engine_redis()
    lock = FencedLock(connection, key=action.resource_identifier, ttl_ms=lock_ttl_ms())
    try:
        fence = lock.acquire(wait_seconds=0.2)
    except LockBusy:
        action_retry_later(
            action_id=action.pk, reason="lock_busy", from_statuses=(ActionStatus.QUEUED,)
        )
        return "lock_busy"
    except (redis.RedisError, DatabaseError) as exc:
        action_retry_later(
            action_id=action.pk,
            reason=f"transient: {type(exc).__name__}",
            from_statuses=(ActionStatus.QUEUED,),
        )
        return "transient"
    try:
        lock.start_heartbeat()
        # Re-read under the lock: a duplicate delivery that waited for it finds
        # the action already done.
        status = Action.objects.filter(pk=action.pk).values_list("status", flat=True).first()
        if status != ActionStatus.QUEUED:
            return f"skipped:{status}"
        if action.kind.target == TargetType.HTTP:
            return _execute_http(action=action, lock=lock, fence=fence)
        return _execute_managed(action=action, lock=lock, fence=fence)
    finally:
        try:
            lock.release()
        except redis.RedisError:
            log.warning("could not release the lock on %s", action.resource_identifier)


def _claim(action: Action, fence: int) -> Operation | None:
    """Open this attempt's operation (the action becomes `executing`), or None when
    the action moved on between our check and the claim."""
    from console.core.operations import open_operation

    try:
        operation = open_operation(
            action_id=action.pk,
            fence=fence,
            worker=worker_name(),
            lease_seconds=operation_lease_seconds(),
        )
    except DomainError as exc:
        log.info("action %s not claimed: %s", action.pk, exc)
        return None
    notify_action_changed_now(action.pk)  # now `executing`
    return operation


def _execute_managed(*, action: Action, lock: Any, fence: int) -> str:
    from console.core.barrier import apply_action

    operation = _claim(action, fence)
    if operation is None:
        return "not_claimed"
    crash_point("after_open_operation")
    try:
        lock.check()
        with transaction.atomic():
            outcome = apply_action(
                action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
            )
            # The barrier leaves wake-ups to its caller.
            notify_action_on_commit(action.pk)
            crash_point("inside_barrier_before_commit")
        crash_point("after_barrier_commit")
    except KillSwitchEngaged as exc:
        # Engaged between our check and the barrier's: nothing was written.
        Operation.objects.filter(pk=operation.pk, status=OperationStatus.PENDING).update(
            status=OperationStatus.FAILED,
            finished_at=timezone.now(),
            outcome={"refused": "kill_switch_engaged"},
        )
        action_pause(
            action_id=action.pk,
            reason=str(exc.extra.get("reason") or exc.message),
            scope=str(exc.extra.get("scope") or ""),
        )
        return "paused"
    except LockLost:
        action_retry_later(action_id=action.pk, reason="lock_lost", operation_id=operation.pk)
        return "lock_lost"
    except (redis.RedisError, DatabaseError) as exc:
        action_retry_later(
            action_id=action.pk,
            reason=f"transient: {type(exc).__name__}",
            operation_id=operation.pk,
        )
        return "transient"
    if getattr(outcome, "applied", False):
        return "applied"
    return route_refusal(
        action_id=action.pk, operation_id=operation.pk, refusal=_refusal_code(outcome)
    )


def _mirror_resource(action: Action, response: Any) -> Any:
    """Keep a local mirror row of an external resource (for conflicts and pages)."""
    from ownership.models import Resource

    version = response.version
    document = response.document if isinstance(response.document, dict) else {}
    resource = Resource.objects.filter(kind=action.kind, name=action.name).first()
    if version is None:
        return resource
    if resource is None:
        resource, _ = Resource.objects.get_or_create(
            kind=action.kind,
            name=action.name,
            defaults={
                "document": document,
                "version": version,
                "owner_group": action.kind.owner_group,
            },
        )
    elif version > resource.version or response.status == 404:
        Resource.objects.filter(pk=resource.pk, version__lt=version).update(
            document=document, version=version, deleted=False, updated_at=timezone.now()
        )
        resource.refresh_from_db()
    return resource


def _execute_http(*, action: Action, lock: Any, fence: int) -> str:
    """One attempt against an external HTTP target (see console.core.targets)."""
    from console.core import targets
    from ownership.models import ResourceVersion

    operation = _claim(action, fence)
    if operation is None:
        return "not_claimed"
    from console.core.barrier import refuse_if_run_ended

    if refuse_if_run_ended(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
    ):
        # Checked before sending; a revoke that commits while the request is in
        # flight cannot recall it from an external target.
        return "run_not_active"
    from console.core.killswitch import engaged_switch_for

    switch = engaged_switch_for(action.resource_identifier)
    if switch is not None:
        # Re-checked right before sending (an external target has no barrier
        # transaction: an engage that commits while the request is in flight
        # cannot recall it).
        Operation.objects.filter(pk=operation.pk, status=OperationStatus.PENDING).update(
            status=OperationStatus.FAILED,
            finished_at=timezone.now(),
            outcome={"refused": "kill_switch_engaged"},
        )
        action_pause(action_id=action.pk, reason=switch.reason, scope=switch.scope)
        return "paused"
    target = targets.HttpTarget(action.kind.target_url)
    # The call may outlast the operation's lease (lock TTL + 2 s): renew the lease
    # with the lock, so the reconciler never abandons a request still in flight.
    lock.on_renew(partial(renew_operation_lease, operation.pk))
    try:
        lock.check()
        response = target.write(
            name=action.name,
            operation=action.operation,
            payload_format=action.payload_format,
            payload=action.payload,
            observed_version=action.observed_version,
            idempotency_key=targets.idempotency_key_for(action.pk),
            fence=fence,
        )
    except LockLost:
        action_retry_later(action_id=action.pk, reason="lock_lost", operation_id=operation.pk)
        return "lock_lost"
    except targets.TargetNotSent as exc:
        action_retry_later(
            action_id=action.pk, reason=f"target_unreachable: {exc}", operation_id=operation.pk
        )
        return "retry"
    except targets.TargetOutcomeUnknown as exc:
        # It may have been applied: the operation is `unknown`; the next attempt
        # replays with the same Idempotency-Key and settles it.
        with transaction.atomic():
            if attempt_superseded(operation.pk):
                return "superseded"
            Operation.objects.filter(pk=operation.pk, status=OperationStatus.PENDING).update(
                status=OperationStatus.UNKNOWN,
                outcome={"unknown": str(exc)},
            )
            _audit_worker_event(
                "write.unknown",
                action,
                {"operation_id": operation.pk, "fence": fence, "error": str(exc)},
            )
        action_retry_later(
            action_id=action.pk, reason="target_timeout_after_send", operation_id=operation.pk
        )
        return "unknown"
    outcome = response.outcome
    if outcome == targets.APPLIED:
        now = timezone.now()
        with transaction.atomic():
            # Lock this attempt's operation, then the action (the barrier's and the
            # reconciler's order). A worker that was paused past its lease resumes
            # here after the reconciler closed its operation and another delivery
            # may already have recorded the effect: it records nothing but closing
            # its own operation (conditionally), so one effect is recorded once.
            mine = Operation.objects.select_for_update().filter(pk=operation.pk).first()
            locked = Action.objects.select_for_update(of=("self",)).get(pk=action.pk)
            if (
                mine is None
                or mine.status != OperationStatus.PENDING
                or locked.status != ActionStatus.EXECUTING
            ):
                Operation.objects.filter(pk=operation.pk, status=OperationStatus.PENDING).update(
                    status=OperationStatus.FAILED,
                    finished_at=now,
                    outcome={"superseded": True, "replayed": response.replayed},
                )
                log.info("action %s: stale delivery of operation %s", action.pk, operation.pk)
                return "superseded"
            resource = _mirror_resource(action, response)
            # A replay settles the earlier `unknown` attempt: that one made the effect.
            unknown = (
                Operation.objects.select_for_update()
                .filter(action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN)
                .order_by("started_at")
                .first()
            )
            effect_op = unknown or operation
            if unknown is not None:
                Operation.objects.filter(pk=operation.pk, status=OperationStatus.PENDING).update(
                    status=OperationStatus.FAILED,
                    finished_at=now,
                    outcome={"replay_of": unknown.pk, "replayed": response.replayed},
                )
                Operation.objects.filter(
                    action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN
                ).exclude(pk=unknown.pk).update(status=OperationStatus.FAILED, finished_at=now)
            settled = Operation.objects.filter(
                pk=effect_op.pk, status__in=(OperationStatus.PENDING, OperationStatus.UNKNOWN)
            ).update(
                status=OperationStatus.DONE,
                base_version=action.observed_version,
                result_version=response.version,
                finished_at=now,
                outcome={
                    "result": "applied",
                    "target_status": response.status,
                    "replayed": response.replayed,
                    "settled_by": operation.pk if unknown is not None else None,
                },
            )
            if not settled:  # cannot happen under the locks above; never record twice
                return "superseded"
            if resource is not None and response.version is not None:
                ResourceVersion.objects.get_or_create(
                    resource=resource,
                    version=response.version,
                    defaults={
                        "document": response.document
                        if isinstance(response.document, dict)
                        else {},
                        "operation": action.operation,
                        "fence": fence,
                        "run_id": action.run_id,
                        "action_id": action.pk,
                        "deleted": action.operation == "delete",
                    },
                )
            moved = action_transition(
                action_id=action.pk,
                from_statuses=(ActionStatus.EXECUTING,),
                to_status=ActionStatus.APPLIED,
                error=None,
                resource=resource,
            )
            assert moved  # the action row is locked and was `executing`
            _audit_worker_event(
                "write.applied",
                action,
                {
                    "target": "http",
                    "operation_id": effect_op.pk,
                    "fence": fence,
                    "from_version": action.observed_version,
                    "to_version": response.version,
                    "replayed": response.replayed,
                },
            )
        return "applied"
    if outcome in (targets.STALE, targets.CONFLICT, targets.NOT_FOUND):
        try:
            current = target.read(action.name)
            with transaction.atomic():
                _mirror_resource(action, current)
        except targets.TargetNotSent:
            pass
        with transaction.atomic():
            if attempt_superseded(operation.pk):
                return "superseded"
            _audit_worker_event(
                "write.refused",
                action,
                {"target": "http", "status": response.status, "operation_id": operation.pk},
            )
        if outcome == targets.NOT_FOUND and action.operation != "create":
            action_fail(
                action_id=action.pk,
                code="not_found",
                reason=f"target answered {response.status}",
                operation_id=operation.pk,
            )
            return "failed"
        return route_refusal(
            action_id=action.pk, operation_id=operation.pk, refusal="stale_version"
        )
    if outcome in (targets.LOCKED, targets.BACKOFF):
        action_retry_later(
            action_id=action.pk,
            reason=f"target_status_{response.status}",
            operation_id=operation.pk,
        )
        return "retry"
    action_fail(
        action_id=action.pk,
        code="target_error",
        reason=f"target answered {response.status}",
        operation_id=operation.pk,
    )
    return "failed"


def route_refusal(*, action_id: uuid.UUID, operation_id: int | None, refusal: str) -> str:
    """What happens to an action whose write the barrier (or a target) refused."""
    from ownership.services.conflicts import conflict_open_for_action

    if refusal == "run_not_active":
        # The barrier already ended the action (cancelled / expired) in its transaction.
        return "run_not_active"
    if refusal in ("stale_version", "missing", "already_exists"):
        conflict_open_for_action(action_id=action_id, operation_id=operation_id, refusal=refusal)
        return "conflict"
    if refusal in ("kill_switch", "kill_switch_engaged"):
        from console.core.killswitch import engaged_switch_for

        action = Action.objects.get(pk=action_id)
        switch = engaged_switch_for(action.resource_identifier)
        reason = switch.reason if switch is not None else "kill switch engaged"
        if operation_id is not None:
            Operation.objects.filter(pk=operation_id, status=OperationStatus.PENDING).update(
                status=OperationStatus.FAILED,
                finished_at=timezone.now(),
                outcome={"refused": refusal},
            )
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


# -- the outbox reconciler ----------------------------------------------------------


def reconcile(
    *, now: datetime | None = None, connection: redis.Redis | None = None
) -> dict[str, int]:
    """Make RQ agree with PostgreSQL. Safe to run concurrently and repeatedly.

    - operations left `pending` by a dead worker past `lease_expires_at`: the
      barrier's single transaction means the write did not commit (else the
      operation would be `done`), so the operation is marked failed (abandoned)
      and the action goes back to `queued` for a new fence;
    - paused actions and paused undos whose kill switch is gone resume;
    - queued actions (not_before passed) and pending undo operations whose job
      is missing from RQ are enqueued again.
    """

    now = now or timezone.now()
    conn = connection or engine_redis()
    counts = {"abandoned": 0, "requeued": 0, "undo_requeued": 0, "resumed": 0}

    stale_ops = list(
        Operation.objects.filter(
            status=OperationStatus.PENDING,
            undo_of__isnull=True,
            lease_expires_at__lt=now,
        ).values_list("pk", "action_id")
    )
    for operation_id, action_id in stale_ops:
        with transaction.atomic():
            closed = Operation.objects.filter(
                pk=operation_id, status=OperationStatus.PENDING, lease_expires_at__lt=now
            ).update(
                status=OperationStatus.FAILED,
                finished_at=now,
                outcome={"abandoned": True, "reason": "lease expired; worker presumed dead"},
            )
            if not closed:
                continue
            action = Action.objects.select_for_update(of=("self",)).get(pk=action_id)
            attempts = action.attempts + 1
            if attempts >= MAX_ATTEMPTS:
                # A delivery that keeps killing its worker is not retried forever.
                action_transition(
                    action_id=action_id,
                    from_statuses=(ActionStatus.EXECUTING,),
                    to_status=ActionStatus.FAILED,
                    attempts=attempts,
                    error={"code": "worker_lost", "attempts": attempts},
                )
                moved = False
            else:
                moved = action_transition(
                    action_id=action_id,
                    from_statuses=(ActionStatus.EXECUTING,),
                    to_status=ActionStatus.QUEUED,
                    attempts=attempts,
                    not_before=None,
                )
            audit_append(
                event_type="operation.abandoned",
                actor=Actor.system("reconciler"),
                resource=action.resource_identifier,
                run_id=action.run_id,
                action_id=action_id,
                details={"operation": operation_id, "requeued": moved, "attempts": attempts},
            )
            if moved:
                _enqueue_on_commit(action_id)
                counts["abandoned"] += 1

    # Actions stuck `executing` without a live operation (claimed, then the
    # worker died before the operation row committed).
    grace = now - timedelta(seconds=operation_lease_seconds())
    orphans = Action.objects.filter(status=ActionStatus.EXECUTING, updated_at__lt=grace).exclude(
        operations__status__in=(OperationStatus.PENDING, OperationStatus.DONE),
        operations__undo_of__isnull=True,
    )
    for action_id in orphans.values_list("pk", flat=True):
        with transaction.atomic():
            if action_transition(
                action_id=action_id,
                from_statuses=(ActionStatus.EXECUTING,),
                to_status=ActionStatus.QUEUED,
            ):
                _enqueue_on_commit(action_id)
                counts["abandoned"] += 1

    # Paused work whose switch is gone (released elsewhere, row deleted) resumes.
    paused = list(
        Action.objects.filter(status=ActionStatus.PAUSED)
        .select_related("kind")
        .order_by("created_at")[:1000]
    )
    if paused:
        from console.models import KillSwitch

        engaged = list(KillSwitch.objects.filter(engaged=True))
        for action in paused:
            if any(switch.covers(action.resource_identifier) for switch in engaged):
                continue
            with transaction.atomic():
                if action_transition(
                    action_id=action.pk,
                    from_statuses=(ActionStatus.PAUSED,),
                    to_status=ActionStatus.QUEUED,
                    paused_reason="",
                    not_before=None,
                ):
                    _enqueue_on_commit(action.pk)
                    counts["resumed"] += 1

    due = (
        Action.objects.filter(
            status=ActionStatus.QUEUED,
            updated_at__lt=now - timedelta(seconds=OUTBOX_GRACE_SECONDS),
        )
        .filter(Q(not_before__isnull=True) | Q(not_before__lte=now))
        .order_by("created_at")
        .values_list("pk", "not_before")
    )

    overdue_before = now - timedelta(seconds=SCHEDULED_OVERDUE_SECONDS)
    for action_id, not_before in due:
        overdue = not_before is not None and not_before < overdue_before
        if not job_is_pending("action", action_id, connection=conn, overdue=overdue):
            enqueue_action_execution(action_id, connection=conn)
            counts["requeued"] += 1

    # Undos a kill switch paused whose switch is gone resume; pending undos whose job
    # Redis lost (FLUSHALL, restart) are sent again. Oldest accepted first.
    pending_undos = Operation.objects.filter(
        status=OperationStatus.PENDING,
        undo_of__isnull=False,
        started_at__lt=now - timedelta(seconds=OUTBOX_GRACE_SECONDS),
    ).filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
    paused_undos = list(
        pending_undos.exclude(paused_reason="")
        .select_related("action")
        .order_by("accepted_at", "started_at")[:1000]
    )
    if paused_undos:
        from console.models import KillSwitch

        engaged = list(KillSwitch.objects.filter(engaged=True))
        for undo_op in paused_undos:
            if any(switch.covers(undo_op.action.resource_identifier) for switch in engaged):
                continue
            if Operation.objects.filter(
                pk=undo_op.pk, status=OperationStatus.PENDING, paused_reason=undo_op.paused_reason
            ).update(paused_reason=""):
                counts["resumed"] += 1
    undo_due = pending_undos.filter(paused_reason="").order_by("accepted_at", "started_at")
    for operation_id in undo_due.values_list("pk", flat=True):
        if not job_is_pending("undo", operation_id, connection=conn):
            enqueue_undo_execution(operation_id, connection=conn)
            counts["undo_requeued"] += 1
    if any(counts.values()):
        log.info("reconcile: %s", counts)
    return counts
