"""Executing approved actions: the job body of one delivery.

Flow of one delivery (`action_execute`):
  1. load the action; anything but `queued` is a no-op (re-delivery, duplicates);
  2. kill switch engaged for the resource -> `paused` with the reason;
  3. take the resource's FencedLock (busy -> retry later with backoff, stays `queued`);
  4. re-check the status now that the lock is held; `open_operation` moves it to
     `executing` with a lease; `apply_action` writes through the barrier in one
     transaction (an external HTTP target: approvals.services.http_writes);
  5. a refusal is routed (approvals.services.attempts.route_refusal): stale
     version -> conflict, kill switch -> paused, stale fence / lost lock ->
     queued again with a new fence on the next attempt; transient errors ->
     exponential backoff with jitter, at most AIRLOCK_MAX_ATTEMPTS, then
     `failed` with the reason.

PostgreSQL is the outbox: approvals.services.reconcile re-enqueues due actions
whose job is missing from RQ and recovers operations a dead worker left
`pending` past their lease.
"""

from __future__ import annotations

import functools
import logging
import uuid
from datetime import timedelta
from typing import Any

import redis
from django.db import DatabaseError
from django.utils import timezone

from approvals.models import Action, ActionStatus
from approvals.outbox import engine_redis, enqueue_action_execution, notify_action_on_commit
from approvals.services.attempts import (
    WORKER_ACTOR,
    action_pause,
    action_retry_later,
    claim,
    crash_point,
    lock_ttl_ms,
    operation_fail_pending,
    route_refusal,
)
from approvals.services.http_writes import execute_http
from console.core.barrier import apply_action
from console.core.errors import KillSwitchEngaged, LockBusy, LockLost
from console.core.killswitch import engaged_switch_for
from console.core.lock import FencedLock
from console.requestctx import reset_request_id, set_request_id
from ownership.models import TargetType

log = logging.getLogger("airlock.execution")


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
        # A duplicate delivery that waited for the lock finds the action done: the
        # claim (a conditional UPDATE from `queued`, under the lock) refuses it.
        if action.kind.target == TargetType.HTTP:
            return execute_http(action=action, lock=lock, fence=fence)
        return _execute_managed(action=action, lock=lock, fence=fence)
    finally:
        try:
            lock.release()
        except redis.RedisError:
            log.warning("could not release the lock on %s", action.resource_identifier)


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


def _before_barrier_commit(action_id: uuid.UUID) -> None:
    # The barrier leaves wake-ups to its caller: registered inside its transaction.
    notify_action_on_commit(action_id)
    crash_point("inside_barrier_before_commit")


def _execute_managed(*, action: Action, lock: Any, fence: int) -> str:
    operation = claim(action, fence)
    if isinstance(operation, str):
        return operation
    crash_point("after_open_operation")
    try:
        lock.check()
        outcome = apply_action(
            action_id=action.pk,
            operation_id=operation.pk,
            fence=fence,
            actor=WORKER_ACTOR,
            before_commit=functools.partial(_before_barrier_commit, action.pk),
        )
        crash_point("after_barrier_commit")
    except KillSwitchEngaged as exc:
        # Engaged between our check and the barrier's: nothing was written.
        operation_fail_pending(operation.pk, {"refused": "kill_switch_engaged"})
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
