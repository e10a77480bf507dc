"""The outbox reconciler: make RQ agree with PostgreSQL.

PostgreSQL is the outbox. Safe to run concurrently and repeatedly (every step
is a conditional UPDATE in its own short transaction):
- operations left `pending` by a dead worker — past `lease_expires_at`, or at
  once when the worker holding them is gone (it stopped publishing its presence:
  approvals/services/worker_presence.py) — the barrier's single transaction means
  the write did not commit (else the operation would be `done`), so the operation
  is marked failed (abandoned) and the action goes back to `queued` for a new fence;
- paused actions and paused undos whose kill switch is gone resume;
- queued actions (not_before passed) and pending undo operations whose job
  is missing from RQ (or "started" by a gone worker) are enqueued again;
- plans still moving are advanced from their steps' states (a worker killed
  between two steps, a plan job Redis lost).
No step looks at a window of the oldest rows only: however much work is parked
behind engaged switches or waits for people, work whose job was lost is found.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from datetime import datetime, timedelta
from typing import TypeVar, cast

import redis
from django.db import transaction
from django.db.models import CharField, Model, Q, QuerySet, Value
from django.db.models.functions import Concat
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from approvals.outbox import (
    engine_redis,
    enqueue_action_execution,
    enqueue_undo_execution,
    jobs_pending,
)
from approvals.services.action_status import action_transition
from approvals.services.attempts import (
    enqueue_on_commit,
    last_read_owed,
    max_attempts,
    operation_lease_seconds,
    schedule_last_read,
    unsettled_outcome,
)
from approvals.services.plan_engine import plans_resume
from approvals.services.worker_presence import workers_gone
from audit.services import Actor
from console.models import KillSwitch
from engine.core.action_audit import audit_action_event

log = logging.getLogger("airlock.execution")

RECONCILER = Actor.system("reconciler")

# How long after its last transition a queued action may lack a job before the
# reconciler resends it (covers the gap between commit and on_commit enqueue).
OUTBOX_GRACE_SECONDS = 2.0
# A retry still only *scheduled* this long after it was due is stuck (no worker
# runs RQ's scheduler): the reconciler enqueues it directly.
SCHEDULED_OVERDUE_SECONDS = 30.0
# Due work asked of RQ at once (jobs_pending): a backlog of N costs 2N/500 round trips.
PENDING_CHECK_CHUNK = 500

T = TypeVar("T")
M = TypeVar("M", bound=Model)


def reconcile(
    *, now: datetime | None = None, connection: redis.Redis | None = None
) -> dict[str, int]:
    """One pass of every step (see the module docstring); returns what each did."""
    now = now or timezone.now()
    conn = connection or engine_redis()
    gone = _GoneWorkers(conn)
    # Pending work whose lease is still running but whose worker is gone (killed mid-write).
    orphaned = Q(worker__in=gone(_lease_holders(now)))
    counts = {
        "abandoned": _abandon_stale_operations(now, orphaned) + _requeue_orphans(now),
        "requeued": 0,
        "undo_requeued": 0,
        "resumed": _resume_paused_actions(),
    }
    counts["requeued"] = _requeue_missing_jobs(now, conn, gone)
    pending_undos = Operation.objects.filter(
        status=OperationStatus.PENDING,
        undo_of__isnull=False,
        started_at__lt=now - timedelta(seconds=OUTBOX_GRACE_SECONDS),
    ).filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now) | orphaned)
    counts["resumed"] += _resume_paused_undos(pending_undos)
    counts["undo_requeued"] = _requeue_missing_undos(pending_undos, conn, gone)
    counts["plans_advanced"] = plans_resume()
    if any(counts.values()):
        log.info("reconcile: %s", counts)
    return counts


class _GoneWorkers:
    """worker_presence.workers_gone, asked at most once a name in a pass (a missing
    presence is confirmed by a second look a beat later: one wait a pass, not one a job)."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection
        self.known: dict[str, bool] = {}

    def __call__(self, names: Collection[str]) -> set[str]:
        new = [name for name in names if name not in self.known]
        if new:
            gone = workers_gone(new, self.connection)
            self.known.update((name, name in gone) for name in new)
        return {name for name in names if self.known.get(name)}


def _lease_holders(now: datetime) -> set[str]:
    """The workers holding a pending operation (a write or an undo) whose lease runs."""
    return set(
        Operation.objects.filter(status=OperationStatus.PENDING, lease_expires_at__gte=now)
        .exclude(worker="")
        .values_list("worker", flat=True)
        .distinct()
    )


def _abandon_stale_operations(now: datetime, orphaned: Q) -> int:
    """Operations a dead worker left `pending` — past their lease, or held by a worker
    that is gone (`orphaned`: no presence, see worker_presence) — failed (abandoned), their
    action queued again for a new fence (or, once attempts run out, failed — or read once more
    first: _end_worker_lost)."""
    count = 0
    stale = Q(lease_expires_at__lt=now) | orphaned
    stale_ops = list(
        Operation.objects.filter(status=OperationStatus.PENDING, undo_of__isnull=True)
        .filter(stale)
        .values_list("pk", "action_id", "lease_expires_at")
    )
    for operation_id, action_id, lease_expires_at in stale_ops:
        reason = (
            "lease expired; worker presumed dead"
            if lease_expires_at is None or lease_expires_at < now
            else "worker gone (no presence); lease not waited out"
        )
        with transaction.atomic():
            closed = (
                Operation.objects.filter(pk=operation_id, status=OperationStatus.PENDING)
                .filter(stale)
                .update(
                    status=OperationStatus.FAILED,
                    finished_at=now,
                    outcome={"abandoned": True, "reason": reason},
                )
            )
            if not closed:
                continue
            action = Action.objects.select_for_update(of=("self",)).get(pk=action_id)
            attempts = action.attempts + 1
            moved = attempts < max_attempts() and action_transition(
                action_id=action_id,
                from_statuses=(ActionStatus.EXECUTING,),
                to_status=ActionStatus.QUEUED,
                attempts=attempts,
                not_before=None,
            )
            audit_action_event(
                action,
                event_type="operation.abandoned",
                actor=RECONCILER,
                details={"operation": operation_id, "requeued": moved, "attempts": attempts},
            )
            if attempts >= max_attempts():
                _end_worker_lost(action, attempts)
            if moved:
                enqueue_on_commit(action_id)
                count += 1
    return count


def _end_worker_lost(action: Action, attempts: int) -> None:
    """Inside the caller's transaction (`action` locked, `executing`): its attempts were spent
    by workers that died. A delivery that keeps killing its worker is not retried forever:
    `failed` — but a write to an external target whose worker may have died after the target
    took it is read once more first (attempts.schedule_last_read): never `failed` on record
    for a write the target may hold."""
    error = {"code": "worker_lost", "attempts": attempts}
    if last_read_owed(action):
        schedule_last_read(
            action,
            from_statuses=(ActionStatus.EXECUTING,),
            attempts=attempts,
            error=error,
            actor=RECONCILER,
        )
        return
    action_transition(
        action_id=action.pk,
        from_statuses=(ActionStatus.EXECUTING,),
        to_status=ActionStatus.FAILED,
        attempts=attempts,
        error={**error, **unsettled_outcome(action)},
    )


def _requeue_orphans(now: datetime) -> int:
    """Actions stuck `executing` without a live operation (claimed, then the worker
    died before the operation row committed)."""
    count = 0
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
                enqueue_on_commit(action_id)
                count += 1
    return count


def _outside_switches(rows: QuerySet[M], path: str = "") -> QuerySet[M] | None:
    """`rows` (actions, or operations with `path` "action__") minus those an engaged kill
    switch covers (KillSwitch.covers, in SQL); None when a switch covers everything.

    In the query, not after a slice of it: however much work is parked behind engaged
    switches, what no switch holds any more is found (issue 38: no window to fill)."""
    scopes = list(KillSwitch.objects.filter(engaged=True).values_list("scope", flat=True))
    if "*" in scopes:
        return None
    if not scopes:
        return rows
    covered = Q()
    for scope in scopes:
        if scope.endswith("*"):
            covered |= Q(switch_target__startswith=scope[:-1])
        else:
            covered |= Q(switch_target=scope)
    identifier = Concat(f"{path}kind_id", Value("/"), f"{path}name", output_field=CharField())
    return cast("QuerySet[M]", rows.annotate(switch_target=identifier).exclude(covered))


def _resume_paused_actions() -> int:
    """Paused work whose switch is gone (released elsewhere, row deleted) resumes,
    oldest first — every such action, however many stay paused behind engaged switches."""
    count = 0
    free = _outside_switches(Action.objects.filter(status=ActionStatus.PAUSED))
    if free is None:
        return 0
    for action_id in free.order_by("created_at").values_list("pk", flat=True).iterator(1000):
        with transaction.atomic():
            if action_transition(
                action_id=action_id,
                from_statuses=(ActionStatus.PAUSED,),
                to_status=ActionStatus.QUEUED,
                paused_reason="",
                not_before=None,
            ):
                enqueue_on_commit(action_id)
                count += 1
    return count


def _requeue_missing_jobs(now: datetime, conn: redis.Redis, gone: _GoneWorkers) -> int:
    """Queued actions (due) whose job RQ does not hold: enqueued again. A backlog is asked
    of RQ a chunk at a time (jobs_pending: two round trips a chunk)."""
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
    count = 0
    for chunk in _chunks(due.iterator(chunk_size=PENDING_CHECK_CHUNK)):
        overdue = {pk for pk, not_before in chunk if not_before and not_before < overdue_before}
        ids = [pk for pk, _ in chunk]
        pending = jobs_pending("action", ids, overdue=overdue, connection=conn, gone_workers=gone)
        for action_id in ids:
            if action_id not in pending:
                enqueue_action_execution(action_id, connection=conn)
                count += 1
    return count


def _chunks(rows: Iterator[T]) -> Iterator[list[T]]:
    """The rows in lists of PENDING_CHECK_CHUNK."""
    chunk: list[T] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == PENDING_CHECK_CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _resume_paused_undos(pending_undos: QuerySet[Operation]) -> int:
    """Undos a kill switch paused whose switch is gone resume (oldest accepted first) —
    every one, however many stay paused behind engaged switches."""
    count = 0
    free = _outside_switches(pending_undos.exclude(paused_reason=""), "action__")
    if free is None:
        return 0
    rows = free.order_by("accepted_at", "started_at").values_list("pk", "paused_reason")
    for operation_id, paused_reason in rows.iterator(1000):
        if Operation.objects.filter(
            pk=operation_id, status=OperationStatus.PENDING, paused_reason=paused_reason
        ).update(paused_reason=""):
            count += 1
    return count


def _requeue_missing_undos(
    pending_undos: QuerySet[Operation], conn: redis.Redis, gone: _GoneWorkers
) -> int:
    """Pending undos whose job Redis lost (FLUSHALL, restart) or whose worker is gone
    are sent again."""
    count = 0
    undo_due = pending_undos.filter(paused_reason="").order_by("accepted_at", "started_at")
    for ids in _chunks(undo_due.values_list("pk", flat=True).iterator(PENDING_CHECK_CHUNK)):
        pending = jobs_pending("undo", ids, connection=conn, gone_workers=gone)
        for operation_id in ids:
            if operation_id not in pending:
                enqueue_undo_execution(operation_id, connection=conn)
                count += 1
    return count
