"""The notifications' periodic pass, scheduled by the Procfile's one cron process
(approvals/cron.py imports this module; see docs/notifications.md).

Every few seconds: resend the deliveries Redis lost, send the approval reminders that
are due, and tell of an audit chain found broken. These jobs go on the `notifications`
queue (the `notify` worker's), not the engine's: none of them may take an engine worker's
time, and with no notifications worker there is nothing they could send anyway.
"""

from __future__ import annotations

from rq import cron

from notifications.jobs import notifications_each_minute_job, notifications_tick_job
from notifications.outbox import QUEUE_NAME

TICK_EVERY_SECONDS = 5
BREAK_CHECK_EVERY_SECONDS = 60

for job, every in (
    (notifications_tick_job, TICK_EVERY_SECONDS),
    (notifications_each_minute_job, BREAK_CHECK_EVERY_SECONDS),
):
    entry = cron.register(job, QUEUE_NAME, interval=every, job_timeout=60, result_ttl=60)
    # django-rq 3.2's DjangoCronScheduler.register() does not accept these keys of rq 2.12.
    entry.pop("webhooks", None)
    entry.pop("name", None)
