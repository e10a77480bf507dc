"""The notifications outbox's sending side: put delivery jobs on RQ (by dotted path, like
approvals/outbox.py, whose Redis, markers and pending-job check it shares).

Deliveries have a queue of their own, `notifications`, served by the Procfile's `notify`
line and never by the engine's workers: a receiver that answers slowly or never holds a
notifications worker for its timeout, and must not hold one that an approved write waits
for (docs/notifications.md "Queues").

A leaf: imports no service and no job module. PostgreSQL holds every pending delivery;
a lost enqueue (Redis down, FLUSHALL) is resent by the reconciler
(notifications/services/delivery.py `deliveries_reconcile`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Sequence
from datetime import timedelta
from typing import Any

import redis
from rq import Queue

from approvals.outbox import MARKER_TTL_SECONDS, engine_redis, jobs_pending, marker_key

log = logging.getLogger("airlock.notifications")

DELIVER_JOB = "notifications.jobs.deliver_job"
MARKER_KIND = "notify"
QUEUE_NAME = "notifications"


def notify_queue(connection: redis.Redis | None = None) -> Queue:
    """The deliveries' queue (and the notifications' periodic jobs'), in the engine's Redis."""
    return Queue(QUEUE_NAME, connection=connection or engine_redis())


def enqueue_deliveries(delivery_ids: Sequence[Any], *, delay_seconds: float = 0.0) -> None:
    """Enqueue one job per delivery in one round trip (call from on_commit). A Redis
    failure is logged, never raised: the reconciler resends what is due."""
    if not delivery_ids:
        return
    try:
        conn = engine_redis()
        queue = notify_queue(conn)
        pipe = conn.pipeline()
        for delivery_id in delivery_ids:
            job_id = f"airlock-{MARKER_KIND}-{delivery_id}-{uuid.uuid4().hex[:12]}"
            options: dict[str, Any] = {
                "job_id": job_id,
                "result_ttl": 0,
                "failure_ttl": 24 * 3600,
                "job_timeout": 60,
                "pipeline": pipe,
            }
            if delay_seconds > 0:
                queue.enqueue_in(
                    timedelta(seconds=delay_seconds), DELIVER_JOB, str(delivery_id), **options
                )
            else:
                queue.enqueue(DELIVER_JOB, str(delivery_id), **options)
            pipe.set(marker_key(MARKER_KIND, delivery_id), job_id, ex=MARKER_TTL_SECONDS)
        pipe.execute()
    except redis.RedisError:
        log.warning("could not enqueue %d deliveries; the reconciler will", len(delivery_ids))


def deliveries_with_jobs(delivery_ids: Sequence[Any], *, overdue: Collection[Any] = ()) -> set[Any]:
    """Those deliveries whose job RQ still holds (queued, scheduled, running)."""
    return jobs_pending(MARKER_KIND, delivery_ids, overdue=overdue)
