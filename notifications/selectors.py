"""Reads of the notifications (admins': the API and console check the role first)."""

from __future__ import annotations

import threading
import time
from typing import Any

from django.db.models import Count, Min, QuerySet, Sum
from django.utils import timezone

from console.permissions import ROLE_ADMIN, user_groups
from engine.core.errors import NotFound
from notifications.models import (
    EVERYONE,
    Channel,
    Delivery,
    DeliveryAttempt,
    DeliveryStatus,
    Subscription,
)
from notifications.services.dispatch import dispatch_lag


def subscription_list() -> list[Subscription]:
    return list(Subscription.objects.select_related("created_by").order_by("id"))


def subscriptions_reaching(user: Any) -> list[Subscription]:
    """The active subscriptions that can reach `user`: those targeting everyone or one of
    the person's groups (`admins` too for a superuser). Email ones reach them only with an
    address on file (the page says so)."""
    groups = set(user_groups(user))
    if getattr(user, "is_superuser", False):
        groups.add(ROLE_ADMIN)
    return [
        subscription
        for subscription in Subscription.objects.filter(
            paused=False, disabled_at__isnull=True
        ).order_by("id")
        if subscription.target == EVERYONE or subscription.target in groups
    ]


def subscription_get(subscription_id: int) -> Subscription:
    subscription = (
        Subscription.objects.select_related("created_by").filter(pk=subscription_id).first()
    )
    if subscription is None:
        raise NotFound(f"No notification subscription {subscription_id}.")
    return subscription


def delivery_list(
    *, subscription: int | None = None, status: str | None = None, event: str | None = None
) -> QuerySet[Delivery]:
    """Deliveries with their notification and attempts (newest first once paginated)."""
    rows = Delivery.objects.select_related("notification").prefetch_related("attempt_rows")
    if subscription is not None:
        rows = rows.filter(subscription_id=subscription)
    if status is not None:
        rows = rows.filter(status=status)
    if event is not None:
        rows = rows.filter(notification__type=event)
    return rows


def delivery_as_dict(delivery: Delivery) -> dict[str, Any]:
    return {
        "id": str(delivery.pk),
        "subscription": delivery.subscription_id,
        "notification": str(delivery.notification_id),
        "event": delivery.notification.type,
        "webhook_id": delivery.webhook_id,
        "status": delivery.status,
        "attempts": delivery.attempts,
        "created_at": delivery.created_at.isoformat(),
        "next_attempt_at": (
            delivery.next_attempt_at.isoformat() if delivery.status == "pending" else None
        ),
        "finished_at": delivery.finished_at.isoformat() if delivery.finished_at else None,
        "last_error": delivery.last_error,
        "attempt_log": [
            {
                "number": attempt.number,
                "started_at": attempt.started_at.isoformat(),
                "status_code": attempt.status_code,
                "latency_ms": attempt.latency_ms,
                "response_excerpt": attempt.response_excerpt,
                "error": attempt.error,
            }
            for attempt in sorted(delivery.attempt_rows.all(), key=lambda a: a.number)
        ],
    }


_METRICS_CACHE_SECONDS = 30.0
_metrics_lock = threading.Lock()
_metrics_cache: tuple[float, dict[str, Any]] | None = None


def _delivery_totals() -> dict[str, Any]:
    """Deliveries by channel and status and the attempts' latency: whole-history totals,
    computed at most every _METRICS_CACHE_SECONDS per process."""
    global _metrics_cache
    with _metrics_lock:
        if _metrics_cache is not None and time.monotonic() - _metrics_cache[0] < (
            _METRICS_CACHE_SECONDS
        ):
            return _metrics_cache[1]
    by_outcome = {
        (row["subscription__channel"], row["status"]): row["n"]
        for row in Delivery.objects.values("subscription__channel", "status").annotate(
            n=Count("id")
        )
    }
    latency = DeliveryAttempt.objects.aggregate(total=Sum("latency_ms"), n=Count("id"))
    oldest = Delivery.objects.filter(status=DeliveryStatus.PENDING).aggregate(
        oldest=Min("created_at")
    )["oldest"]
    totals = {
        "by_outcome": by_outcome,
        "latency_ms": latency["total"] or 0,
        "n": latency["n"],
        "oldest_pending": oldest,
        "unread": dispatch_lag(),
    }
    with _metrics_lock:
        _metrics_cache = (time.monotonic(), totals)
    return totals


def notification_metrics() -> list[str]:
    """Prometheus lines for /metrics: deliveries by channel and outcome, attempt latency,
    the age of the oldest delivery still pending (its creation time read with the totals:
    a scrape inside the cache window runs no query of ours)."""
    totals = _delivery_totals()
    oldest = totals["oldest_pending"]
    age = (timezone.now() - oldest).total_seconds() if oldest else 0.0
    lines = [
        "# HELP airlock_notification_deliveries Deliveries by channel and status "
        f"(refreshed every {_METRICS_CACHE_SECONDS:.0f} s).",
        "# TYPE airlock_notification_deliveries gauge",
    ]
    for channel in Channel.values:
        for status in DeliveryStatus.values:
            count = totals["by_outcome"].get((channel, status), 0)
            lines.append(
                f'airlock_notification_deliveries{{channel="{channel}",status="{status}"}} {count}'
            )
    lines += [
        "# HELP airlock_notification_attempt_latency_seconds Time one delivery attempt took.",
        "# TYPE airlock_notification_attempt_latency_seconds summary",
        f"airlock_notification_attempt_latency_seconds_sum {totals['latency_ms'] / 1000:.3f}",
        f"airlock_notification_attempt_latency_seconds_count {totals['n']}",
        "# HELP airlock_notification_oldest_pending_seconds Age of the oldest undelivered "
        "notification (0 when none waits; which one is refreshed every "
        f"{_METRICS_CACHE_SECONDS:.0f} s).",
        "# TYPE airlock_notification_oldest_pending_seconds gauge",
        f"airlock_notification_oldest_pending_seconds {age:.3f}",
        "# HELP airlock_notification_unread_audit_events Audit events committed that the "
        "notify worker has not read for notifications yet (stays high: no notify worker).",
        "# TYPE airlock_notification_unread_audit_events gauge",
        f"airlock_notification_unread_audit_events {totals['unread']}",
    ]
    return lines
