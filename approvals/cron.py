"""RQ cron configuration: `python manage.py rqcron approvals.cron`.

Run one such process next to the workers (`rqworker --with-scheduler`, the
scheduler is needed for the engine's backoff retries, which use enqueue_in).
The cron process keeps its schedule in memory, so a Redis FLUSHALL or
restart does not stop the outbox reconciler.
"""

from __future__ import annotations

from rq import cron

from approvals.jobs import QUEUE_NAME, housekeeping_job, reconcile_job

cron.register(reconcile_job, QUEUE_NAME, interval=5, job_timeout=60, result_ttl=60)
cron.register(housekeeping_job, QUEUE_NAME, interval=30, job_timeout=120, result_ttl=60)
