"""The Procfile's `notify` worker class: RQ's SimpleWorker with the notifications' jobs
loaded up front (as approvals/worker.py does for the engine's), serving the
`notifications` queue only, with its deliveries in flight side by side, and reading the
audit chain for the events to tell (notifications/dispatcher.py).

A SimpleWorker runs each job in the worker's own process (no fork per job). A delivery job
hands its delivery to one of AIRLOCK_NOTIFY_CONCURRENCY threads (notifications/
delivery_pool.py) and returns: a receiver that never answers holds one thread for its
timeout while the other subscriptions' deliveries go out on the others. The claim
(`claimed_until`) with the reconciler covers a worker that dies with attempts in flight.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rq.worker import SimpleWorker

import notifications.jobs  # noqa: F401  # the job functions the outbox enqueues by dotted path
from notifications.delivery_pool import delivery_pool_close, delivery_pool_open
from notifications.dispatcher import chain_reader_start, chain_reader_stop


class NotifyWorker(SimpleWorker):
    """A SimpleWorker that imported the notifications' jobs before its first job, delivers
    on a pool of threads and reads the audit chain on another while it works."""

    def work(self, *args: Any, **kwargs: Any) -> bool:
        delivery_pool_open(int(settings.AIRLOCK_NOTIFY_CONCURRENCY))
        chain_reader_start(float(settings.AIRLOCK_NOTIFY_DISPATCH_SECONDS))
        try:
            return bool(super().work(*args, **kwargs))
        finally:
            chain_reader_stop()
            # A warm shutdown lets the attempts in flight be recorded (each within its
            # timeout); one killed instead leaves claims that lapse and are resent.
            delivery_pool_close()
