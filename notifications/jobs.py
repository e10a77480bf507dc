"""RQ jobs of the notifications: thin, take ids, call one service each (enqueued by dotted
path from notifications/outbox.py; the periodic one scheduled by notifications/cron.py)."""

from __future__ import annotations

import uuid

from django.db import close_old_connections

from notifications.delivery_pool import delivery_start
from notifications.services.periodic import notifications_each_minute, notifications_tick


def deliver_job(delivery_id: str) -> str:
    # On the notify worker's pool when it has one (notifications/delivery_pool.py).
    return delivery_start(uuid.UUID(delivery_id))


def notifications_tick_job() -> dict[str, int]:
    close_old_connections()
    try:
        return notifications_tick()
    finally:
        close_old_connections()


def notifications_each_minute_job() -> dict[str, int]:
    close_old_connections()
    try:
        return notifications_each_minute()
    finally:
        close_old_connections()
