"""The outbox reconciler: make RQ agree with PostgreSQL.

PostgreSQL is the outbox. Safe to run concurrently and repeatedly (every step
is a conditional UPDATE in its own short transaction):
- operations left `pending` by a dead worker past `lease_expires_at`: the
  barrier's single transaction means the write did not commit (else the
  operation would be `done`), so the operation is marked failed (abandoned)
  and the action goes back to `queued` for a new fence;
- paused actions and paused undos whose kill switch is gone resume;
- queued actions (not_before passed) and pending undo operations whose job
  is missing from RQ are enqueued again;
- plans still moving are advanced from their steps' states (a worker killed
  between two steps, a plan job Redis lost).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import TypeVar

import redis
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from approvals.outbox import (
    engine_redis,
    enqueue_action_execution,
    enqueue_undo_execution,
    jobs_pending,
)
from approvals.services.action_status import action_transition
from approvals.services.attempts import enqueue_on_commit, max_attempts, operation_lease_seconds
from approvals.services.plan_engine import plans_resume
from audit.services import Actor
from console.core.action_audit import audit_action_event
from console.models import KillSwitch

log = logging.getLogger("airlock.execution")

# How long after its last transition a queued action may lack a job before the
# reconciler resends it (covers the gap between commit and on_commit enqueue).
OUTBOX_GRACE_SECONDS = 2.0
# A retry still only *scheduled* this long after it was due is stuck (no worker
# runs RQ's scheduler): the reconciler enqueues it directly.
SCHEDULED_OVERDUE_SECONDS = 30.0
# Due work asked of RQ at once (jobs_pending): a backlog of N costs 2N/500 round trips.
PENDING_CHECK_CHUNK = 500

T = TypeVar("T")


def reconcile(
    *, now: datetime | None = None, connection: redis.Redis | None = None
) -> dict[str, int]:
    """One pass of every step (see the module docstring); returns what each did."""
    now = now or timezone.now()
    conn = connection or engine_redis()
    counts = {
        "abandoned": _abandon_stale_operations(now) + _requeue_orphans(now),
        "requeued": 0,
        "undo_requeued": 0,
        "resumed": _resume_paused_actions(),
    }
    counts["requeued"] = _requeue_missing_jobs(now, conn)
    pending_undos = Operation.objects.filter(
        status=OperationStatus.PENDING,
        undo_of__isnull=False,
        started_at__lt=now - timedelta(seconds=OUTBOX_GRACE_SECONDS),
    ).filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
    counts["resumed"] += _resume_paused_undos(pending_undos)
    counts["undo_requeued"] = _requeue_missing_undos(pending_undos, conn)
    counts["plans_advanced"] = plans_resume()
    if any(counts.values()):
        log.info("reconcile: %s", counts)
    return counts


def _abandon_stale_operations(now: datetime) -> int:
    """Operations a dead worker left `pending` past their lease: failed (abandoned),
    their action queued again for a new fence (or failed once attempts run out)."""
    count = 0
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
            if attempts >= max_attempts():
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
            audit_action_event(
                action,
                event_type="operation.abandoned",
                actor=Actor.system("reconciler"),
                details={"operation": operation_id, "requeued": moved, "attempts": attempts},
            )
            if moved:
                enqueue_on_commit(action_id)
                count += 1
    return count


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


def _resume_paused_actions() -> int:
    """Paused work whose switch is gone (released elsewhere, row deleted) resumes."""
    count = 0
    paused = list(
        Action.objects.filter(status=ActionStatus.PAUSED)
        .select_related("kind")
        .order_by("created_at")[:1000]
    )
    if not paused:
        return 0
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
                enqueue_on_commit(action.pk)
                count += 1
    return count


def _requeue_missing_jobs(now: datetime, conn: redis.Redis) -> int:
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
        pending = jobs_pending("action", ids, overdue=overdue, connection=conn)
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
    """Undos a kill switch paused whose switch is gone resume (oldest accepted first)."""
    count = 0
    paused_undos = list(
        pending_undos.exclude(paused_reason="")
        .select_related("action")
        .order_by("accepted_at", "started_at")[:1000]
    )
    if not paused_undos:
        return 0
    engaged = list(KillSwitch.objects.filter(engaged=True))
    for undo_op in paused_undos:
        if any(switch.covers(undo_op.action.resource_identifier) for switch in engaged):
            continue
        if Operation.objects.filter(
            pk=undo_op.pk, status=OperationStatus.PENDING, paused_reason=undo_op.paused_reason
        ).update(paused_reason=""):
            count += 1
    return count


def _requeue_missing_undos(pending_undos: QuerySet[Operation], conn: redis.Redis) -> int:
    """Pending undos whose job Redis lost (FLUSHALL, restart) are sent again."""
    count = 0
    undo_due = pending_undos.filter(paused_reason="").order_by("accepted_at", "started_at")
    for ids in _chunks(undo_due.values_list("pk", flat=True).iterator(PENDING_CHECK_CHUNK)):
        pending = jobs_pending("undo", ids, connection=conn)
        for operation_id in ids:
            if operation_id not in pending:
                enqueue_undo_execution(operation_id, connection=conn)
                count += 1
    return count
