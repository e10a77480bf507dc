"""Deliveries in flight side by side: a bounded pool of threads in the `notify` worker.

A delivery spends its time waiting on a receiver, and a receiver that accepts the connection
and never answers holds its attempt for AIRLOCK_WEBHOOK_TIMEOUT_SECONDS. Run one at a time,
as a plain RQ worker does, every other subscription's deliveries would wait behind it. So
`NotifyWorker` (notifications/worker.py) opens this pool before its first job, and each
delivery job hands its delivery to a free thread and returns at once; with every thread
busy the job waits for one (the worker takes no further job meanwhile). A subscription has
one attempt in flight at most (notifications/services/delivery.py `_claim`), so a dead
receiver holds one thread, never the pool.

What RQ no longer sees, PostgreSQL still holds: the attempt's claim (`claimed_until`) and
its outcome are rows, so a worker that dies with attempts in flight leaves claims that
lapse and the reconciler resends those deliveries (the same `webhook-id`), as it did when
the worker ran one. Without a pool (a plain worker, a test calling the job) the job
delivers inline.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

from django.db import close_old_connections

from notifications.services.delivery import delivery_attempt

log = logging.getLogger("airlock.notifications")


def delivery_attempt_closing(delivery_id: uuid.UUID) -> str:
    """One attempt, with this thread's database connection checked before and after (each
    pool thread has its own, kept between attempts as a worker's is)."""
    close_old_connections()
    try:
        return delivery_attempt(delivery_id=delivery_id)
    finally:
        close_old_connections()


class DeliveryPool:
    """`size` threads; `submit` waits for a free one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = threading.BoundedSemaphore(size)
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="notify")

    def submit(self, delivery_id: uuid.UUID) -> None:
        self._free.acquire()
        try:
            self._executor.submit(self._attempt, delivery_id)
        except BaseException:
            self._free.release()
            raise

    def _attempt(self, delivery_id: uuid.UUID) -> None:
        try:
            outcome = delivery_attempt_closing(delivery_id)
            log.debug("delivery %s: %s", delivery_id, outcome)
        except Exception:  # a database outage: the claim lapses and the reconciler resends
            log.exception("delivery %s: the attempt failed", delivery_id)
        finally:
            self._free.release()

    def close(self) -> None:
        """Wait for the attempts in flight to be recorded (each ends within its timeout)."""
        self._executor.shutdown(wait=True)


_pool: DeliveryPool | None = None


def delivery_pool_open(size: int) -> DeliveryPool:
    """Deliver on `size` threads in this process from now on (NotifyWorker, at its start)."""
    global _pool
    _pool = DeliveryPool(size)
    return _pool


def delivery_pool_close() -> None:
    """Back to inline delivery, after the attempts in flight end (NotifyWorker, at its end)."""
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.close()


def delivery_start(delivery_id: uuid.UUID) -> str:
    """Hand the delivery to a pool thread ("in flight"), or, with no pool open, attempt it
    here and return what happened."""
    pool = _pool
    if pool is None:
        return delivery_attempt_closing(delivery_id)
    pool.submit(delivery_id)
    return "in flight"
