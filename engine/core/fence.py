"""Fencing tokens: monotonic, issued by PostgreSQL (never by Redis).

Redis may lose every key (FLUSHALL, restart without persistence); the fence
comes from PostgreSQL, which is the source of truth, so a holder that acquires
a lock after such a loss still gets a token greater than every token issued
before — and the write barrier (`last_fence < :fence`) keeps refusing the old ones.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.models import F, Max

from approvals.models import Operation
from console.models import FenceCounter
from console.tracing import traced
from ownership.models import OwnershipRecord, Resource

FENCE_SEQUENCE = "airlock_fence_seq"

log = logging.getLogger("airlock.fence")

# The floor is checked once per process, before its first fence: a web or
# worker process started on a database restored from backup (rows newer than
# the sequence) then never hands out a fence the barrier refuses as stale.
_floor_lock = threading.Lock()
_floor_checked = False


@traced("airlock.fence", result="airlock.fence")
def next_fence() -> int:
    """Return a fencing token strictly greater than every token issued before.

    PostgreSQL: `nextval('airlock_fence_seq')` — non-transactional, so a
    rolled-back caller never causes a token to be handed out twice.
    SQLite (embedded default): a conditional UPDATE of the FenceCounter row;
    SQLite serialises writers, so the increment-then-read is atomic.
    The first call in a process lifts the source to the fence floor first
    (ensure_fence_floor_once).
    """
    ensure_fence_floor_once()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT nextval(%s)", [FENCE_SEQUENCE])
            row = cursor.fetchone()
        assert row is not None
        return int(row[0])

    with transaction.atomic():
        updated = FenceCounter.objects.filter(pk=1).update(value=F("value") + 1)
        if not updated:
            FenceCounter.objects.create(pk=1, value=max(fence_floor(), 0) + 1)
        return int(FenceCounter.objects.values_list("value", flat=True).get(pk=1))


def fence_floor() -> int:
    """The highest fence PostgreSQL has ever accepted or recorded (0 when none)."""
    candidates = [
        Resource.objects.aggregate(m=Max("last_fence"))["m"],
        Operation.objects.aggregate(m=Max("fence"))["m"],
        OwnershipRecord.objects.aggregate(m=Max("fence"))["m"],
    ]
    return max((int(c) for c in candidates if c is not None), default=0)


def current_fence() -> int:
    """The last fence handed out (0 before the first), without consuming one."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT last_value, is_called FROM {FENCE_SEQUENCE}")  # noqa: S608
            row = cursor.fetchone()
        assert row is not None
        return int(row[0]) if row[1] else int(row[0]) - 1
    value = FenceCounter.objects.filter(pk=1).values_list("value", flat=True).first()
    return int(value or 0)


def ensure_fence_floor() -> int:
    """Raise the fence source above every accepted fence if it is ever behind.

    Safety after a database restore (the sequence restored older than the
    rows): `migrate` runs it (post_migrate) and every process runs it before
    its first fence (ensure_fence_floor_once). Only ever moves the source up.
    Returns the floor that was checked. Meant for quiet moments: a fence
    issued concurrently between the check and the setval could be issued twice,
    which the barrier tolerates (`last_fence < :fence` refuses the second).
    """
    floor = fence_floor()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT setval(%s, %s, true) FROM {FENCE_SEQUENCE} "  # noqa: S608
                "WHERE (CASE WHEN is_called THEN last_value ELSE last_value - 1 END) < %s",
                [FENCE_SEQUENCE, floor, floor],
            )
        return floor
    with transaction.atomic():
        FenceCounter.objects.filter(pk=1, value__lt=floor).update(value=floor)
        FenceCounter.objects.get_or_create(pk=1, defaults={"value": floor})
    return floor


def ensure_fence_floor_once() -> None:
    """ensure_fence_floor, the first time this process asks (thread-safe)."""
    global _floor_checked
    if _floor_checked:
        return
    with _floor_lock:
        if _floor_checked:
            return
        floor = ensure_fence_floor()
        log.info("fence floor %s checked for this process", floor)
        _floor_checked = True


def forget_fence_floor_check() -> None:
    """Make the next fence of this process check the floor again (after a restore
    under a running process, and in tests standing in for a fresh process)."""
    global _floor_checked
    with _floor_lock:
        _floor_checked = False


def ensure_fence_floor_after_migrate(*, using: str = DEFAULT_DB_ALIAS, **kwargs: Any) -> None:
    """post_migrate receiver: `manage.py migrate` lifts the fence source too.

    Skipped when the tables it reads are not there (a partial or reverse
    migration), so `migrate <app> zero` keeps working.
    """
    if using != DEFAULT_DB_ALIAS:
        return
    needed = {m._meta.db_table for m in (Operation, OwnershipRecord, Resource)}
    tables = set(connections[using].introspection.table_names())
    if not needed <= tables:
        return
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [FENCE_SEQUENCE])
            row = cursor.fetchone()
        if not row or not row[0]:
            return
    floor = ensure_fence_floor()
    log.info("fence floor %s checked after migrate", floor)
