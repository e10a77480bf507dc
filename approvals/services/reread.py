"""The periodic re-read (issue 39): a write or an undo on an external target that ended with
its outcome unknown — its last read could not read the target (attempts.schedule_last_read,
external_undo `_last_read`): `failed`, `last_read: unsettled` — is read again later, from the
cron process (approvals/cron.py), until the target answers. Nothing is ever sent: a read.

A write (the action `failed`, its lost attempt `unknown`), read as its next attempt would:
- our document under a new version → recorded `applied` now, once: the lost operation `done`
  (`settled_later`), the action `applied`, `write.applied` saying so. Its undo window starts
  now: nothing on record offered an undo while the write was unsettled;
- still the version it was written on → not applied: the action stays `failed`, its error and
  `action.reread` now carrying what the read saw (`last_read: not_applied`);
- someone else's version → `last_read: conflict` on the action's error and in
  `action.reread`, for a person to see — not routed into new work (the action has ended), and
  the outcome stays unknown (ours may have landed before theirs);
- unreadable → unchanged; read again after a backoff (doubling, capped at an hour).
An undo (its operation `failed` and unsettled, still the newest undo of its write): the prior
document under a new version → undone (external_undo `undo_reread`); the write's version →
not done; else a conflict, said on the undo operation.

Bounded: only what ended less than AIRLOCK_REREAD_MAX_AGE_HOURS ago, REREAD_BATCH writes and
REREAD_BATCH undos a tick, each no sooner than its backoff allows. Every record is a
conditional UPDATE under row locks, so two ticks at once settle one thing once.

Each read and its record hold the resource's fenced lock (engine/core/lock.py), the one a
write or an undo of it holds while it sends: a write cannot land between what the re-read
saw and what it records (the mirror put back behind the target, stale evidence). A busy
lock is not waited for: the resource is `busy` this tick (no backoff, no audit row) and
read on the next one. The lock is checked after the read, and the mirror checks the fence
itself (ownership.targets.mirror_snapshot): a re-read paused past the lock's TTL after its
check resumes after a newer holder wrote and recorded; what it read is still true of the
lost attempt and is recorded on it, but the mirror keeps the newer holder's record.

A plan step whose write is settled `applied` after its plan stopped is compensated too:
each tick ends with plan_engine.plans_settled_late (the plan reopened, the step undone in
its place in reverse order — docs/plans-compensation.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import redis
from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from approvals.outbox import engine_redis
from approvals.services.action_status import action_transition
from approvals.services.attempts import lock_ttl_ms, worker_name
from approvals.services.external_undo import undo_reread
from approvals.services.external_writes import (
    Intended,
    intended_write,
    mirror_written,
    operation_record_applied,
)
from approvals.services.plan_engine import plans_settled_late
from audit.services import Actor
from engine.core.action_audit import audit_action_event
from engine.core.errors import LockBusy, LockLost
from engine.core.lock import FencedLock
from engine.targets.base import (
    Applied,
    NotApplied,
    Snapshot,
    TargetConfigError,
    TargetError,
    settle_by_reading,
)
from ownership.targets import adapter_for_kind, mirror_snapshot

log = logging.getLogger("airlock.execution")

REREAD = Actor.system("reread")
# Writes (and undos) read in one tick: the cron job stays short however many are unsettled.
REREAD_BATCH = 10
BACKOFF_CAP_SECONDS = 3600.0
# How each read came out (`busy`: the resource's lock was held, read next tick), and how
# many plans a step settled late sent back to compensating.
RESULTS = (
    "applied",
    "not_applied",
    "conflict",
    "unreadable",
    "superseded",
    "busy",
    "plans_reopened",
)


def reread_unsettled(
    *, now: datetime | None = None, connection: redis.Redis | None = None
) -> dict[str, int]:
    """One tick: read the due unsettled writes, then undos, each under its resource's lock;
    then the plans a step settled late reopens. Returns how each came out."""
    now = now or timezone.now()
    counts = dict.fromkeys(RESULTS, 0)
    conn = connection or engine_redis()
    for operation in _writes_due(now):
        counts[_locked(conn, operation.action, partial(_reread_write, operation, now))] += 1
    for undo_op in _undos_due(now):
        result = _locked(conn, undo_op.action, partial(undo_reread, undo_op, actor=REREAD))
        if result == "unreadable":
            _later(Operation.objects.filter(pk=undo_op.pk), now, "the target could not be read")
        counts[result] += 1
    counts["plans_reopened"] = plans_settled_late(since=_since(now))
    if any(counts.values()):
        log.info("reread: %s", counts)
    return counts


def _locked(connection: redis.Redis, action: Action, read_and_record: Callable[..., str]) -> str:
    """`read_and_record(lock=lock)` under the resource's fenced lock, taken without waiting:
    `busy` when someone holds it (a write or an undo sending, another tick) — read on the
    next tick, nothing recorded and no backoff spent. Redis or the fence unreachable is
    `busy` too: nothing was read."""
    lock = FencedLock(
        connection, key=action.resource_identifier, ttl_ms=lock_ttl_ms(), holder=worker_name()
    )
    try:
        lock.acquire(wait_seconds=0.0)
    except (LockBusy, redis.RedisError, DatabaseError):
        return "busy"
    try:
        lock.start_heartbeat()  # a slow read outlasting the TTL keeps the lock
        return read_and_record(lock=lock)
    except LockLost:
        return "busy"  # lost before the record: someone may be writing; nothing recorded
    finally:
        try:
            lock.release()
        except redis.RedisError:
            log.warning("reread: could not release the lock on %s", action.resource_identifier)


def _due(now: datetime) -> Q:
    """Never re-read, or its backoff has passed."""
    return ~Q(outcome__has_key="reread") | Q(outcome__reread__next__lte=now.timestamp())


def _since(now: datetime) -> datetime:
    return now - timedelta(hours=int(settings.AIRLOCK_REREAD_MAX_AGE_HOURS))


def _writes_due(now: datetime) -> list[Operation]:
    """The lost attempt of each unsettled write (its earliest `unknown` one), a batch."""
    rows = (
        Operation.objects.select_related("action__kind", "action__conflict_class")
        .filter(
            _due(now),
            status=OperationStatus.UNKNOWN,
            undo_of__isnull=True,
            action__status=ActionStatus.FAILED,
            action__error__last_read="unsettled",
            action__updated_at__gte=_since(now),
        )
        .exclude(action__kind__target="managed")
        .order_by("started_at")
    )
    picked: dict[Any, Operation] = {}
    for operation in rows[: REREAD_BATCH * 4]:
        picked.setdefault(operation.action_id, operation)
        if len(picked) == REREAD_BATCH:
            break
    return list(picked.values())


def _undos_due(now: datetime) -> list[Operation]:
    """Unsettled undos that are still the newest undo of their write (a later one — asked
    again, a plan's next compensation — reads the target itself and owns the outcome)."""
    later = Operation.objects.filter(
        undo_of=OuterRef("undo_of"), started_at__gt=OuterRef("started_at")
    )
    return list(
        Operation.objects.select_related("undo_of", "action__kind", "action__conflict_class")
        .filter(
            _due(now),
            status=OperationStatus.FAILED,
            undo_of__isnull=False,
            undo_of__status=OperationStatus.DONE,
            outcome__last_read="unsettled",
            finished_at__gte=_since(now),
        )
        .exclude(action__kind__target="managed")
        .exclude(Exists(later))
        .order_by("finished_at")[:REREAD_BATCH]
    )


def _later(rows: Any, now: datetime, error: str) -> None:
    """Still unreadable: the next read of these operations after a backoff."""
    base = max(1.0, float(settings.AIRLOCK_REREAD_EVERY_SECONDS))
    for operation in rows.only("pk", "outcome"):
        outcome = dict(operation.outcome) if isinstance(operation.outcome, dict) else {}
        count = int((outcome.get("reread") or {}).get("count", 0)) + 1
        wait = min(BACKOFF_CAP_SECONDS, base * 2 ** (count - 1))
        outcome["reread"] = {
            "count": count,
            "at": now.isoformat(),
            "next": (now + timedelta(seconds=wait)).timestamp(),
            "error": error[:300],
        }
        Operation.objects.filter(pk=operation.pk).update(outcome=outcome)


def _reread_write(operation: Operation, now: datetime, lock: FencedLock) -> str:
    """Read the target for the write's lost attempt and record what it shows (under `lock`:
    LockLost when it was lost before the record)."""
    action = operation.action
    try:
        adapter = adapter_for_kind(action.kind)
        intended = intended_write(action, adapter)
        if isinstance(intended, Snapshot):
            raise TargetError("the document written could not be rebuilt from the target")
        settled = settle_by_reading(
            adapter,
            action.name,
            written_document=intended.document,
            observed_version=action.observed_version,
            deleted=intended.deleted,
        )
    except (TargetError, TargetConfigError) as exc:
        unknown = Operation.objects.filter(
            action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN
        )
        _later(unknown, now, str(exc))
        return "unreadable"
    lock.check()  # still ours: nothing was written since the read
    held = int(lock.fence or 0)  # the store's check too: the TTL may pass before the record
    if isinstance(settled, Applied):
        return _record_applied(operation, action, intended, settled.version, now, held)
    result = "not_applied" if isinstance(settled, NotApplied) else "conflict"
    return _record_not_done(operation, action, result, settled.current, now, held)


def _lock_unsettled(operation: Operation, action: Action) -> tuple[Operation, Action] | None:
    """Inside a transaction: the lost attempt (still `unknown`), then its action (still
    failed and unsettled) — the barrier's order; None when another tick settled it first."""
    lost = (
        Operation.objects.select_for_update()
        .filter(pk=operation.pk, status=OperationStatus.UNKNOWN)
        .first()
    )
    locked = (
        Action.objects.select_for_update(of=("self",))
        .filter(pk=action.pk, status=ActionStatus.FAILED, error__last_read="unsettled")
        .first()
    )
    if lost is None or locked is None:
        return None
    return lost, locked


def _record_applied(
    operation: Operation,
    action: Action,
    intended: Intended,
    version: str | None,
    now: datetime,
    held_fence: int,
) -> str:
    with transaction.atomic():
        held = _lock_unsettled(operation, action)
        if held is None:
            return "superseded"
        lost, locked = held
        resource = mirror_written(
            action, intended, version, fence=lost.fence, guard_fence=held_fence
        )
        before = dict(lost.outcome) if isinstance(lost.outcome, dict) else {}
        operation_record_applied(
            lost.pk,
            action=action,
            version=version,
            now=now,
            outcome={
                "settled_by_reading": True,
                "settled_later": True,
                "unknown": before.get("unknown"),
                "reread": {
                    **(before.get("reread") or {}),
                    "result": "applied",
                    "at": now.isoformat(),
                },
            },
        )
        Operation.objects.filter(
            action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN
        ).update(status=OperationStatus.FAILED, finished_at=now, outcome={"settles": lost.pk})
        action_transition(
            action_id=action.pk,
            from_statuses=(ActionStatus.FAILED,),
            to_status=ActionStatus.APPLIED,
            error=None,
            resource=resource,
        )
        audit_action_event(
            locked,
            event_type="write.applied",
            actor=REREAD,
            details={
                "target": action.kind.target,
                "operation_id": lost.pk,
                "fence": lost.fence,
                "from_version": action.observed_version,
                "to_version": version,
                "settled_by_reading": True,
                "settled_later": True,
                "failed_at": locked.updated_at.isoformat(),
                "failed_error": locked.error,
            },
        )
    return "applied"


def _record_not_done(
    operation: Operation,
    action: Action,
    result: str,
    current: Snapshot,
    now: datetime,
    held_fence: int,
) -> str:
    """Not ours at the target: the version written on (not applied: the lost attempts close
    so) or someone else's (a conflict: the lost attempt stays `unknown`)."""
    evidence = {
        "last_read": result,
        "current_version": current.version,
        "settled_later": now.isoformat(),
    }
    with transaction.atomic():
        held = _lock_unsettled(operation, action)
        if held is None:
            return "superseded"
        lost, locked = held
        mirror_snapshot(action.kind, action.name, current, guard_fence=held_fence)
        error = dict(locked.error) if isinstance(locked.error, dict) else {}
        before = dict(lost.outcome) if isinstance(lost.outcome, dict) else {}
        reread = {**(before.get("reread") or {}), "result": result, "at": now.isoformat()}
        if result == "not_applied":
            error.pop("outcome", None)  # no longer unknown: the read is the evidence
            Operation.objects.filter(
                action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN
            ).update(
                status=OperationStatus.FAILED,
                finished_at=now,
                outcome={**before, "settled": "not_applied", "by": "reread", "reread": reread},
            )
        else:
            Operation.objects.filter(pk=lost.pk).update(outcome={**before, "reread": reread})
        action_transition(
            action_id=action.pk,
            from_statuses=(ActionStatus.FAILED,),
            to_status=ActionStatus.FAILED,
            error={**error, **evidence},
        )
        audit_action_event(
            locked,
            event_type="action.reread",
            actor=REREAD,
            details={"result": result, "operation_id": lost.pk, **evidence},
        )
    return result
