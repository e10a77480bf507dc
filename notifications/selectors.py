"""Reads of the notifications (admins': the API and console check the role first)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from console.core.errors import NotFound
from notifications.models import Delivery, Subscription


def subscription_list() -> list[Subscription]:
    return list(Subscription.objects.select_related("created_by").order_by("id"))


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
