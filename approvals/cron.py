"""RQ cron configuration: `python manage.py rqcron approvals.cron`.

Run one such process next to the workers (`rqworker --with-scheduler`; the
worker's scheduler is what runs the engine's backoff retries, which use
enqueue_in). The cron process keeps its schedule in memory, so a Redis
FLUSHALL or restart does not stop the outbox reconciler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from rq import cron

from approvals.jobs import housekeeping_job, reconcile_job, reread_job
from approvals.outbox import QUEUE_NAME
from audit.jobs import audit_verify_job

RECONCILE_EVERY_SECONDS = 5
HOUSEKEEPING_EVERY_SECONDS = 30


def _register(func: Callable[..., Any], **options: Any) -> None:
    entry = cron.register(func, QUEUE_NAME, **options)
    # django-rq 3.2's DjangoCronScheduler.register() does not accept the
    # `webhooks` and `name` keys rq 2.12 puts in every entry; drop them (unused).
    entry.pop("webhooks", None)
    entry.pop("name", None)


_register(reconcile_job, interval=RECONCILE_EVERY_SECONDS, job_timeout=60, result_ttl=60)
_register(housekeeping_job, interval=HOUSEKEEPING_EVERY_SECONDS, job_timeout=120, result_ttl=60)
# Writes and undos left with their outcome unknown, read again (0: off; on by default).
if settings.AIRLOCK_REREAD_EVERY_SECONDS > 0:
    _register(
        reread_job, interval=settings.AIRLOCK_REREAD_EVERY_SECONDS, job_timeout=300, result_ttl=60
    )
_register(audit_verify_job, interval=3600, job_timeout=3600, result_ttl=3600)  # whole chain hourly

# The notifications' schedule (reminders, lost deliveries, a broken chain told) runs in the
# same cron process: one Procfile line, one clock.
import notifications.cron  # noqa: E402, F401
