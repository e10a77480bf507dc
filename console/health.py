"""What a deployment's health is made of, read once for `/readyz`, `manage.py doctor` and
`/metrics`: the database and Redis answer, every migration is applied, workers listen on
the engine's queue and the cron process (the outbox reconciler's clock) is alive.

Heartbeats are RQ's own: a worker's key in Redis lives while it sends heartbeats (every job
and every idle wait), and the cron scheduler records its last heartbeat on every loop. After
a Redis restart both come back on their own (a worker re-registers at its next heartbeat
only once restarted, which is why a readiness probe that fails then is the right answer:
nothing consumes the queue until it does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import redis
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone
from rq import Queue, Worker
from rq.cron import CronScheduler
from rq.worker import BaseWorker

from approvals.outbox import QUEUE_NAME
from audit.linker import audit_unlinked

# A cron scheduler loops every few seconds (the reconciler runs every 5 s): one silent for
# this long is gone.
CRON_HEARTBEAT_FRESH_SECONDS = 60


@dataclass(frozen=True)
class Readiness:
    """Each part's state ("ok" or what is wrong) and the counts behind it."""

    parts: dict[str, str]
    workers: int = 0
    cron_schedulers: int = 0
    pending_migrations: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return all(state == "ok" for state in self.parts.values())


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def pending_migrations(alias: str = DEFAULT_DB_ALIAS) -> list[str]:
    """`app.name` of every migration not applied to the database (empty: up to date)."""
    connection = connections[alias]
    executor = MigrationExecutor(connection)
    targets = executor.loader.graph.leaf_nodes()
    return [f"{m.app_label}.{m.name}" for m, _backwards in executor.migration_plan(targets)]


def live_workers(connection: redis.Redis, queue_name: str = QUEUE_NAME) -> list[BaseWorker]:
    """RQ workers listening on a queue, the engine's by default (their keys expire without
    heartbeats)."""
    queue = Queue(queue_name, connection=connection)
    return [w for w in Worker.all(queue=queue) if queue_name in w.queue_names()]


def live_cron_schedulers(connection: redis.Redis, *, now: datetime | None = None) -> list[str]:
    """Names of the cron schedulers whose last heartbeat is recent."""
    now = now or timezone.now()
    fresh_after = now - timedelta(seconds=CRON_HEARTBEAT_FRESH_SECONDS)
    names = []
    for scheduler in CronScheduler.all(connection):
        beat = scheduler.last_heartbeat
        if beat is not None and timezone.is_naive(beat):
            beat = timezone.make_aware(beat, UTC)
        if beat is not None and beat >= fresh_after:
            names.append(scheduler.name)
    return names


def _audit_linking() -> str:
    """ "ok" while committed audit events get linked within the bound (audit/linker.py)."""
    try:
        behind = audit_unlinked().behind_seconds()
    except Exception as exc:
        return f"unknown: {type(exc).__name__}"
    if behind <= settings.AIRLOCK_AUDIT_LINK_BOUND_SECONDS:
        return "ok"
    return f"events wait {behind:.0f} s to be linked (is the `audit` process running?)"


def readiness() -> Readiness:
    """Every part checked, none allowed to raise: a probe answers even when all is down."""
    parts: dict[str, str] = {}
    pending: list[str] = []
    try:
        pending = pending_migrations()
        parts["database"] = "ok"
        parts["migrations"] = "ok" if not pending else f"{len(pending)} not applied"
    except Exception as exc:
        parts["database"] = f"down: {type(exc).__name__}"
        parts["migrations"] = "unknown (database down)"
    if parts["migrations"] == "ok":
        parts["audit"] = _audit_linking()
    workers = schedulers = 0
    try:
        client = redis_client()
        try:
            client.ping()
            parts["redis"] = "ok"
            workers = len(live_workers(client))
            schedulers = len(live_cron_schedulers(client))
        finally:
            client.close()
        parts["workers"] = "ok" if workers else f"no worker listens on the {QUEUE_NAME!r} queue"
        parts["cron"] = "ok" if schedulers else "no cron process (no recent heartbeat)"
    except Exception as exc:
        parts["redis"] = f"down: {type(exc).__name__}"
        parts["workers"] = parts["cron"] = "unknown (redis down)"
    return Readiness(
        parts=parts, workers=workers, cron_schedulers=schedulers, pending_migrations=pending
    )
