"""Executing approved actions: the job body of one delivery.

Flow of one delivery (`action_execute`):
  1. load the action; anything but `queued` is a no-op (re-delivery, duplicates);
  2. kill switch engaged for the resource -> `paused` with the reason;
  3. take the resource's FencedLock (busy -> retry later with backoff, stays `queued`;
     busy because another job's batch took it for this very action -> nothing to do);
  4. the drain (`batch` > 1, the worker's job): the next due queued writes on other
     resources whose locks are free join, all under one fence (FencedLockGroup);
  5. the claim: one short transaction moves every write of the batch still `queued`
     to `executing` with a pending operation (engine.core.operations.open_operations);
     the batched actions' own jobs are taken off the queue;
  6. the apply: ONE transaction — the plain updates and deletes together
     (engine.core.batch_write: one conditional UPDATE, one statement per table to record
     them), anything else through `apply_action` (the barrier); a failing write makes the
     batch redo itself a write at a time, each in its own savepoint; the audit events are
     appended together last (audit_deferred);
  7. each result is settled on its own (approvals.services.attempts): stale version
     -> conflict, kill switch -> paused, stale fence / lost lock -> queued again with
     a new fence on the next attempt; transient errors -> exponential backoff with
     jitter, at most AIRLOCK_MAX_ATTEMPTS, then `failed` with the reason.
An external target is one write with its own lock (approvals.services.external_writes).

PostgreSQL is the outbox: approvals.services.reconcile re-enqueues due actions
whose job is missing from RQ and recovers operations a dead worker left
`pending` past their lease (a worker killed mid-batch leaves the whole batch so).
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

import redis
from django.db import DatabaseError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation
from approvals.outbox import (
    engine_redis,
    enqueue_action_execution,
    notify_actions_now,
    withdraw_action_jobs,
)
from approvals.services.attempts import (
    WORKER_ACTOR,
    action_pause,
    action_retry_later,
    crash_point,
    lock_ttl_ms,
    operation_fail_pending,
    operation_lease_seconds,
    route_refusal,
    worker_name,
)
from approvals.services.external_writes import execute_external
from approvals.services.plan_engine import plan_after_action
from approvals.services.worker_presence import acquire_taking_over, release_lock_of_gone_worker
from audit.services import audit_deferred
from console.compiled_query import CompiledQuery, Param
from console.requestctx import log_action, log_fence, reset_request_id, set_request_id
from engine.core.barrier import WriteOutcome, apply_action
from engine.core.batch_write import apply_locked_batch
from engine.core.errors import KillSwitchEngaged, LockBusy, LockLost
from engine.core.killswitch import engaged_switch_for, engaged_switches
from engine.core.lock import FencedLock, FencedLockGroup
from engine.core.operations import open_operations
from engine.core.write_rows import lock_batch_rows
from ownership.models import ResourceKind
from ownership.targets import in_caller_transaction

log = logging.getLogger("airlock.execution")

_ACTION_ID = Action._meta.get_field("id")
_NOT_BEFORE = Action._meta.get_field("not_before")
_TARGET = ResourceKind._meta.get_field("target")


# Every job's first read, and the drain's look for companions: compiled once a process.
_ACTION_TO_EXECUTE = CompiledQuery(
    lambda: Action.objects.select_related("kind", "conflict_class", "run").filter(
        pk=Param("id", _ACTION_ID)
    )
)


def _companion_query(limit: int) -> QuerySet[Action]:
    """Due queued writes of the lead's target type, oldest first (see _companions)."""
    return (
        Action.objects.filter(status=ActionStatus.QUEUED)
        .filter(Q(not_before__isnull=True) | Q(not_before__lte=Param("now", _NOT_BEFORE)))
        .exclude(pk=Param("lead", _ACTION_ID))
        # The lead's target type: its adapter writes in the caller's transaction, and so do
        # those of every kind of the same target type (the capability is the adapter's).
        .filter(kind__target=Param("target", _TARGET))
        # What a companion is used for before lock_batch_rows loads it whole: its lock
        # (kind and name), its place in proposal order, its id.
        .only("id", "kind_id", "name", "created_at")
        .order_by("created_at")[:limit]
    )


_COMPANIONS: dict[int, CompiledQuery] = {}


def action_execute(
    *, action_id: uuid.UUID, connection: redis.Redis | None = None, batch: int = 1
) -> str:
    """Execute one delivery of an action's job. Idempotent; returns a short outcome.

    `batch` > 1 (the worker's job): a write to a managed resource also drains up to
    `batch - 1` other due queued writes on distinct resources, in the same transaction
    (see _drain); the returned outcome is still this action's."""
    action = _ACTION_TO_EXECUTE.first(id=action_id)
    if action is None:
        return "missing"
    token = set_request_id(action.request_id or f"action-{action.pk}")
    log_action(action)  # its run and resource on the job's log lines
    try:
        return _execute(action, connection=connection, batch=batch)
    finally:
        reset_request_id(token)


def _execute(action: Action, *, connection: redis.Redis | None, batch: int) -> str:
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
    # By what the kind's adapter can do, not by its name: an adapter that writes in this
    # transaction goes through the barrier and may join a batch; any other is one call to a
    # system of its own (external_writes.py).
    if not in_caller_transaction(action.kind):
        return _execute_external(action, connection=connection)
    # The lead's own lock is named after this worker, not the action: a busy lock of a
    # duplicate delivery is waited for, as any busy lock; one whose worker is gone is taken
    # over; only a live batch's companion lock says it was taken for this action.
    lock = FencedLock(
        connection, key=action.resource_identifier, ttl_ms=lock_ttl_ms(), holder=worker_name()
    )
    try:
        if not lock.try_acquire():
            holder = lock.holder_token()
            # A gone worker's lock (killed mid-write) is taken over, not waited out.
            gone = holder is not None and release_lock_of_gone_worker(lock, token=holder)
            if not gone and _batched_elsewhere(holder, action):
                return "skipped:batched"
            lock.take(wait_seconds=0.2)
        group = FencedLockGroup(connection, [lock])
        group.join(_companions(action, connection, limit=batch - 1))  # the free ones
        fence = group.fence()
        log_fence(fence)
    except (LockBusy, redis.RedisError, DatabaseError) as exc:
        if not isinstance(exc, LockBusy):  # what was taken before the failure goes back
            _release_quietly(lock)
        return _retry_unlocked(action, exc)
    try:
        group.start_heartbeat()
        return _drain(action, group, fence)
    finally:
        try:
            group.release()
        except redis.RedisError:
            log.warning("could not release the locks of a batch led by %s", action.pk)


def _execute_external(action: Action, *, connection: redis.Redis) -> str:
    """A write to an external target: one action, its own lock
    (approvals.services.external_writes)."""
    lock = FencedLock(
        connection, key=action.resource_identifier, ttl_ms=lock_ttl_ms(), holder=worker_name()
    )
    try:
        fence = acquire_taking_over(lock, wait_seconds=0.2)
        log_fence(fence)
    except (LockBusy, redis.RedisError, DatabaseError) as exc:
        return _retry_unlocked(action, exc)
    try:
        lock.start_heartbeat()
        return execute_external(action=action, lock=lock, fence=fence)
    finally:
        _release_quietly(lock)


def _retry_unlocked(action: Action, exc: Exception) -> str:
    """No lock and fence (busy, or Redis/PostgreSQL unreachable): nothing was claimed;
    the action stays queued and is delivered again after a backoff."""
    busy = isinstance(exc, LockBusy)
    action_retry_later(
        action_id=action.pk,
        reason="lock_busy" if busy else f"transient: {type(exc).__name__}",
        from_statuses=(ActionStatus.QUEUED,),
    )
    return "lock_busy" if busy else "transient"


def _batched_elsewhere(holder: str | None, action: Action) -> bool:
    """Is the busy lock (held under the token `holder`) held by another job's batch *for
    this very action*? Then that batch claims it: nothing to wait for. (Should that batch
    drop the action, the action stays queued without a job, and the reconciler sends it
    again a few seconds later; should its worker die, the lock is taken over above.)"""
    return holder is not None and holder.startswith(f"{action.pk}:")


def _release_quietly(lock: FencedLock) -> None:
    try:
        lock.release()
    except redis.RedisError:
        log.warning("could not release the lock on %s", lock.key)


class _BatchLock(FencedLock):
    """A companion's lock, with the action it was taken for."""

    def __init__(self, connection: redis.Redis, action: Action) -> None:
        super().__init__(
            connection,
            key=action.resource_identifier,
            ttl_ms=lock_ttl_ms(),
            holder=f"{action.pk}:{worker_name()}",  # the action first: _batched_elsewhere
        )
        self.action = action


def _companions(lead: Action, connection: redis.Redis, *, limit: int) -> list[FencedLock]:
    """Up to `limit` other due queued writes to managed resources, oldest first, each on
    a resource of its own (not the lead's) and not held by a kill switch: their locks,
    not yet taken, each named after the action it is for (a kill switch is checked again
    by the barrier; here it only keeps paused work out)."""
    if limit < 1:
        return []
    switches = engaged_switches()
    query = _COMPANIONS.get(limit * 2)
    if query is None:  # one a batch size: the worker's is a setting
        query = _COMPANIONS[limit * 2] = CompiledQuery(lambda: _companion_query(limit * 2))
    candidates = query.all(now=timezone.now(), lead=lead.pk, target=lead.kind.target)
    locks: list[FencedLock] = []
    resources = {lead.resource_identifier}
    for candidate in candidates:
        resource = candidate.resource_identifier
        if resource in resources or any(s.covers(resource) for s in switches):
            continue
        resources.add(resource)
        locks.append(_BatchLock(connection, candidate))
        if len(locks) == limit:
            break
    return locks


def _drain(lead: Action, group: FencedLockGroup, fence: int) -> str:
    """Claim the batch (one short transaction), then apply it (ONE transaction, the
    audit events appended together last; see _apply_batch), then settle each
    write's outcome on its own: a refusal, a kill switch or an error of one write never
    undoes the others. A worker killed in between leaves claimed operations pending: the
    reconciler abandons them after their lease and queues the actions again."""
    actions = [lead, *(lock.action for lock in group.locks if isinstance(lock, _BatchLock))]
    actions.sort(key=lambda a: a.created_at)  # the batch writes in proposal order
    operations = open_operations(
        action_ids=[a.pk for a in actions],
        fence=fence,
        worker=worker_name(),
        lease_seconds=operation_lease_seconds(),
    )
    claimed = [a for a in actions if a.pk in operations]
    if not claimed:
        return _skipped(lead)
    notify_actions_now([a.pk for a in claimed])  # now `executing`
    withdraw_action_jobs([a.pk for a in claimed if a.pk != lead.pk])
    crash_point("after_open_operation")
    group.renew()
    locks = {lock.key: lock for lock in group.locks}
    results = _apply_batch(claimed, operations, locks, fence)
    crash_point("after_barrier_commit")
    notify_actions_now([a.pk for a in claimed if isinstance(results[a.pk], WriteOutcome)])
    outcomes = {a.pk: _settle(a, operations[a.pk].pk, results[a.pk]) for a in claimed}
    # The lead's job moves its own plan; a batched write that is a plan's step (or the
    # resolution of one) moves its plan here.
    in_plans = Action.objects.filter(pk__in=[a.pk for a in claimed if a.pk != lead.pk]).filter(
        Q(plan_step__isnull=False) | Q(parent__isnull=False)
    )
    for action_id in in_plans.values_list("pk", flat=True):
        plan_after_action(action_id=action_id)
    return outcomes[lead.pk] if lead.pk in outcomes else _skipped(lead)


def _skipped(action: Action) -> str:
    """The outcome of a delivery whose action someone else moved on (it was not claimed)."""
    status = Action.objects.filter(pk=action.pk).values_list("status", flat=True).first()
    return f"skipped:{status or 'missing'}"


_Result = WriteOutcome | KillSwitchEngaged | LockLost | DatabaseError


class _BatchRolledBack(DatabaseError):
    """A failed savepoint rollback doomed the whole batch transaction."""


class _RedoWithSavepoints(Exception):
    """A write of a batch applied without savepoints failed: the batch is redone with them."""


def _apply_batch(
    claimed: list[Action],
    operations: dict[uuid.UUID, Operation],
    locks: dict[str, FencedLock],
    fence: int,
) -> dict[uuid.UUID, _Result]:
    """Apply the claimed writes in one transaction. First together, without a savepoint per
    write (batch_write.py: one UPDATE for the plain writes, one statement per table to
    record them): a failing write (an error, a kill switch) is rare, and then
    the whole transaction rolls back and the batch is applied again with a savepoint per
    write, so that the failure stays that write's own and the others are applied."""
    try:
        return _apply_batch_once(claimed, operations, locks, fence, savepoints=False)
    except _RedoWithSavepoints as exc:
        log.info("a batched write failed (%s): applying the batch with savepoints", exc.__cause__)
        return _apply_batch_once(claimed, operations, locks, fence, savepoints=True)


def _apply_batch_once(
    claimed: list[Action],
    operations: dict[uuid.UUID, Operation],
    locks: dict[str, FencedLock],
    fence: int,
    *,
    savepoints: bool,
) -> dict[uuid.UUID, _Result]:
    results: dict[uuid.UUID, _Result] = {}
    try:
        with transaction.atomic(), audit_deferred() as events:
            rows = lock_batch_rows([(a.pk, operations[a.pk].pk) for a in claimed])
            live = []
            for action in claimed:
                if locks[action.resource_identifier].lost:
                    results[action.pk] = LockLost(f"lost the lock on {action.resource_identifier}")
                else:
                    live.append(action)
            if not savepoints and all(action.pk in rows for action in live):
                try:  # the usual case: the plain writes land together (batch_write.py)
                    together = [rows[action.pk] for action in live]
                    results.update(apply_locked_batch(together, fence=fence, actor=WORKER_ACTOR))
                except (KillSwitchEngaged, DatabaseError) as exc:
                    raise _RedoWithSavepoints(type(exc).__name__) from exc
            else:
                for action in live:
                    mark = events.mark()
                    try:
                        results[action.pk] = apply_action(
                            action_id=action.pk,
                            operation_id=operations[action.pk].pk,
                            fence=fence,
                            actor=WORKER_ACTOR,
                            locked=rows.get(action.pk),
                            savepoint=savepoints,
                        )
                    except (KillSwitchEngaged, DatabaseError) as exc:
                        if not savepoints:
                            raise _RedoWithSavepoints(type(exc).__name__) from exc
                        events.discard_after(mark)  # its savepoint rolled back
                        results[action.pk] = exc
            if transaction.get_rollback():
                raise _BatchRolledBack("the batch transaction can no longer commit")
            crash_point("inside_barrier_before_commit")
    except DatabaseError as exc:
        return {action.pk: exc for action in claimed}
    return results


def _settle(action: Action, operation_id: int, result: _Result) -> str:
    """Route one write's result, in its own short transaction (attempts.py)."""
    if isinstance(result, KillSwitchEngaged):
        # Engaged between our check and the barrier's: nothing was written.
        operation_fail_pending(operation_id, {"refused": "kill_switch_engaged"})
        action_pause(
            action_id=action.pk,
            reason=str(result.extra.get("reason") or result.message),
            scope=str(result.extra.get("scope") or ""),
        )
        return "paused"
    if isinstance(result, LockLost):
        action_retry_later(action_id=action.pk, reason="lock_lost", operation_id=operation_id)
        return "lock_lost"
    if isinstance(result, DatabaseError):
        action_retry_later(
            action_id=action.pk,
            reason=f"transient: {type(result).__name__}",
            operation_id=operation_id,
        )
        return "transient"
    if result.applied:
        return "applied"
    return route_refusal(
        action_id=action.pk, operation_id=operation_id, refusal=result.reason or ""
    )
