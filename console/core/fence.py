"""Fencing tokens: monotonic, issued by PostgreSQL (never by Redis).

Redis may lose every key (FLUSHALL, restart without persistence); the fence
comes from PostgreSQL, which is the source of truth, so a holder that acquires
a lock after such a loss still gets a token greater than every token issued
before — and the write barrier (`last_fence < :fence`) keeps refusing the old ones.
"""

from __future__ import annotations

from django.db import connection, transaction
from django.db.models import F, Max

FENCE_SEQUENCE = "airlock_fence_seq"


def next_fence() -> int:
    """Return a fencing token strictly greater than every token issued before.

    PostgreSQL: `nextval('airlock_fence_seq')` — non-transactional, so a
    rolled-back caller never causes a token to be handed out twice.
    SQLite (embedded default): a conditional UPDATE of the FenceCounter row;
    SQLite serialises writers, so the increment-then-read is atomic.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT nextval(%s)", [FENCE_SEQUENCE])
            row = cursor.fetchone()
        assert row is not None
        return int(row[0])

    from console.models import FenceCounter

    with transaction.atomic():
        updated = FenceCounter.objects.filter(pk=1).update(value=F("value") + 1)
        if not updated:
            FenceCounter.objects.create(pk=1, value=max(fence_floor(), 0) + 1)
        return int(FenceCounter.objects.values_list("value", flat=True).get(pk=1))


def fence_floor() -> int:
    """The highest fence PostgreSQL has ever accepted or recorded (0 when none)."""
    from approvals.models import Operation
    from ownership.models import OwnershipRecord, Resource

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
    from console.models import FenceCounter

    value = FenceCounter.objects.filter(pk=1).values_list("value", flat=True).first()
    return int(value or 0)


def ensure_fence_floor() -> int:
    """Raise the fence source above every accepted fence if it is ever behind.

    Cheap safety after a database restore (the sequence restored older than the
    rows) — the reconciler may call it at start-up. Only ever moves the source
    up. Returns the floor that was checked. Meant for quiet moments: a fence
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
    from console.models import FenceCounter

    with transaction.atomic():
        FenceCounter.objects.filter(pk=1, value__lt=floor).update(value=floor)
        FenceCounter.objects.get_or_create(pk=1, defaults={"value": floor})
    return floor
