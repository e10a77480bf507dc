"""Delivering one Delivery: claim it, send it through its subscription's channel outside
any transaction, then record the attempt and what comes next, in one transaction.

- Claim: a conditional UPDATE (pending, due, not claimed by a live worker) that counts the
  attempt; 0 rows means another worker has it, or it is no longer due. A worker killed
  mid-delivery leaves a claim that lapses (`claimed_until`), and the reconciler resends it:
  a receiver may then see the same `webhook-id` twice (at least once), never a new one.
- One attempt in flight per subscription: the claim holds the subscription's row (FOR NO KEY
  UPDATE, which the outbox's inserts of new deliveries do not wait for) while it checks that
  no other delivery of it has a live claim, so a receiver that never answers holds one of
  the notify worker's threads (notifications/delivery_pool.py), never all of them. A
  delivery found "busy" is left due, untouched; when the attempt in flight is recorded, the
  subscription's next due delivery is enqueued (and the reconciler skips a busy subscription's
  deliveries, so they are not resent every pass only to be found busy again).
- Retries: exponential backoff with full jitter (AIRLOCK_NOTIFY_BACKOFF_*), at least what
  a Retry-After asks, for AIRLOCK_NOTIFY_RETRY_WINDOW_SECONDS after the event; then
  `failed`. 410 Gone disables the subscription (audited, and told to the admins' own
  subscriptions as `subscription.disabled`).
"""

from __future__ import annotations

import json
import logging
import random
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q
from django.utils import timezone

from audit.services import Actor, audit_append
from console.permissions import ROLE_ADMIN
from notifications.models import (
    EVERYONE,
    Channel,
    Delivery,
    DeliveryAttempt,
    DeliveryStatus,
    Notification,
    Subscription,
)
from notifications.outbox import deliveries_with_jobs, enqueue_deliveries
from notifications.services.channels import Sent, apprise_send, email_send, webhook_send
from notifications.services.secrets import unseal

log = logging.getLogger("airlock.notifications")

# A due delivery whose job should have run this long ago is resent by the reconciler even
# when RQ still holds it as scheduled (no worker runs the scheduler).
_OVERDUE_SECONDS = 10


def _notification_body(notification: Notification) -> bytes:
    """The webhook body, the same bytes on every retry: {"type", "timestamp", "data"}."""
    document = {
        "type": notification.type,
        "timestamp": notification.created_at.isoformat().replace("+00:00", "Z"),
        "data": notification.data,
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _notification_text(notification: Notification) -> tuple[str, str]:
    """A chat message's or email's title and body: what happened, and the deep link."""
    data = notification.data
    what = notification.type.replace(".", " ").replace("_", " ")
    about = data.get("resource") or data.get("scope") or data.get("run") or ""
    title = f"Airlock: {what}" + (f" — {about}" if about else "")
    lines = [title]
    for label, key in (
        ("Agent", "agent"),
        ("Run", "run"),
        ("Class", "conflict_class"),
        ("Decision", "decision"),
        ("Deadline", "deadline"),
        ("Reason", "reason"),
    ):
        if data.get(key):
            lines.append(f"{label}: {data[key]}")
    lines.append(f"Open in Airlock (sign-in required): {data.get('link', '')}")
    return title, "\n".join(lines)


def backoff_seconds(attempt: int) -> float:
    """The wait after failed attempt number `attempt` (1-based): full jitter, capped."""
    base = float(settings.AIRLOCK_NOTIFY_BACKOFF_BASE_SECONDS)
    ceiling = min(float(settings.AIRLOCK_NOTIFY_BACKOFF_CAP_SECONDS), base * 2 ** (attempt - 1))
    return random.uniform(ceiling / 2, ceiling)


def delivery_attempt(*, delivery_id: Any) -> str:
    """One attempt of a delivery (the RQ job's work). Returns what happened: "skipped"
    (not ours to send now), "busy" (another delivery of its subscription is in flight: sent
    after it), "delivered", "retry", "failed", "disabled"."""
    now = timezone.now()
    claim = _claim(delivery_id, now)
    if claim != "claimed":
        return claim
    delivery = Delivery.objects.select_related("notification", "subscription").get(pk=delivery_id)
    subscription = delivery.subscription
    if subscription.paused or subscription.disabled_at is not None:
        Delivery.objects.filter(pk=delivery.pk, status=DeliveryStatus.PENDING).update(
            status=DeliveryStatus.DISABLED,
            finished_at=now,
            claimed_until=None,
            last_error="the subscription is paused or disabled",
        )
        return "disabled"
    started = timezone.now()
    sent = _send(delivery, subscription)
    return _record(delivery, sent, started=started)


def _in_flight(subscription_id: Any, now: datetime) -> Any:
    """The subscription's deliveries with a live claim (an attempt in flight)."""
    return Delivery.objects.filter(
        subscription_id=subscription_id, status=DeliveryStatus.PENDING, claimed_until__gte=now
    )


def _claim(delivery_id: Any, now: datetime) -> str:
    """Claim the delivery for one attempt (counted): "claimed", "busy" or "skipped"."""
    lease = timedelta(seconds=int(settings.AIRLOCK_NOTIFY_CLAIM_SECONDS))
    with transaction.atomic():
        # Holding the subscription's row makes the check below and the claim one step for
        # every worker: two deliveries of one subscription are never claimed side by side.
        subscription_id = (
            Subscription.objects.select_for_update(no_key=True, of=("self",))
            .filter(deliveries__pk=delivery_id)
            .values_list("pk", flat=True)
            .first()
        )
        if subscription_id is None:
            return "skipped"
        if _in_flight(subscription_id, now).exclude(pk=delivery_id).exists():
            return "busy"
        claimed = Delivery.objects.filter(
            Q(claimed_until__isnull=True) | Q(claimed_until__lt=now),
            pk=delivery_id,
            status=DeliveryStatus.PENDING,
            next_attempt_at__lte=now,
        ).update(
            claimed_until=now + lease,
            attempts=F("attempts") + 1,
        )
    return "claimed" if claimed else "skipped"


def _send_next(subscription_id: Any) -> None:
    """Enqueue the subscription's oldest due delivery that waited for the one just recorded
    (after that one's commit, so nothing is found busy by the attempt that just ended)."""
    now = timezone.now()
    waiting = list(
        Delivery.objects.filter(
            Q(claimed_until__isnull=True) | Q(claimed_until__lt=now),
            subscription_id=subscription_id,
            status=DeliveryStatus.PENDING,
            next_attempt_at__lte=now,
        )
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:1]
    )
    enqueue_deliveries(waiting)


def _secrets(subscription: Subscription, now: datetime) -> list[str]:
    current = [unseal(subscription.secret_encrypted)]
    until = subscription.previous_secret_until
    if subscription.previous_secret_encrypted and until is not None and until > now:
        current.append(unseal(subscription.previous_secret_encrypted))
    return current


def _send(delivery: Delivery, subscription: Subscription) -> Sent:
    notification = delivery.notification
    try:
        if subscription.channel == Channel.WEBHOOK:
            now = timezone.now()
            return webhook_send(
                url=unseal(subscription.url_encrypted),
                secrets=_secrets(subscription, now),
                webhook_id=delivery.webhook_id,
                timestamp=now,
                body=_notification_body(notification),
            )
        title, body = _notification_text(notification)
        if subscription.channel == Channel.APPRISE:
            return apprise_send(url=unseal(subscription.url_encrypted), title=title, body=body)
        return email_send(
            recipients=_recipients(subscription, notification), subject=title, body=body
        )
    except Exception as exc:  # a bug or a lost key: recorded (without detail) and retried
        log.exception("delivery %s could not be sent", delivery.pk)
        return Sent(ok=False, error=f"internal error: {type(exc).__name__}")


def _recipients(subscription: Subscription, notification: Notification) -> list[str]:
    """The active members of the target group (`*`: of the groups the event concerns)
    who have an email address."""
    groups = (
        list(notification.audience) if subscription.target == EVERYONE else [subscription.target]
    )
    users = get_user_model().objects.filter(is_active=True).exclude(email="")
    condition = Q(groups__name__in=groups)
    if ROLE_ADMIN in groups:
        condition |= Q(is_superuser=True)
    return sorted(set(users.filter(condition).values_list("email", flat=True)))


def _record(delivery: Delivery, sent: Sent, *, started: datetime) -> str:
    now = timezone.now()
    window_end = delivery.created_at + timedelta(
        seconds=int(settings.AIRLOCK_NOTIFY_RETRY_WINDOW_SECONDS)
    )
    delay = 0.0
    if sent.ok:
        outcome, status = "delivered", DeliveryStatus.DELIVERED
    elif sent.gone:
        outcome, status = "disabled", DeliveryStatus.DISABLED
    elif sent.final:
        outcome, status = "failed", DeliveryStatus.FAILED
    else:
        delay = max(backoff_seconds(delivery.attempts), sent.retry_after or 0.0)
        retry = now + timedelta(seconds=delay) < window_end
        outcome, status = (
            ("retry", DeliveryStatus.PENDING) if retry else ("failed", DeliveryStatus.FAILED)
        )
    with transaction.atomic():
        if sent.gone:
            # The subscription's row first: two workers told 410 at once then queue on it,
            # instead of each holding its own delivery and waiting for the other's.
            _subscription_disable(delivery.subscription_id, reason="the endpoint answered 410 Gone")
        DeliveryAttempt.objects.create(
            delivery=delivery,
            number=delivery.attempts,
            started_at=started,
            status_code=sent.status_code,
            latency_ms=sent.latency_ms,
            response_excerpt=sent.excerpt[:1000],
            error=sent.error[:500],
        )
        # Only while this attempt is still the delivery's latest (a claim that lapsed
        # and was taken again leaves the newer attempt to decide).
        Delivery.objects.filter(
            pk=delivery.pk, status=DeliveryStatus.PENDING, attempts=delivery.attempts
        ).update(
            status=status,
            claimed_until=None,
            next_attempt_at=now + timedelta(seconds=delay),
            finished_at=None if status == DeliveryStatus.PENDING else now,
            last_error=sent.error[:500],
        )
        if outcome == "retry":
            delivery_id = delivery.pk
            transaction.on_commit(lambda: enqueue_deliveries([delivery_id], delay_seconds=delay))
        subscription_id = delivery.subscription_id
        transaction.on_commit(lambda: _send_next(subscription_id))
    return outcome


def _subscription_disable(subscription_id: int, *, reason: str) -> None:
    now = timezone.now()
    disabled = Subscription.objects.filter(pk=subscription_id, disabled_at__isnull=True).update(
        disabled_at=now, disabled_reason=reason
    )
    if not disabled:
        return
    Delivery.objects.filter(subscription_id=subscription_id, status=DeliveryStatus.PENDING).update(
        status=DeliveryStatus.DISABLED, finished_at=now, last_error=reason
    )
    audit_append(
        event_type="notification_subscription.disabled",
        actor=Actor.system("notifications"),
        details={"id": subscription_id, "reason": reason},
    )


def deliveries_reconcile(*, now: datetime | None = None, limit: int = 500) -> int:
    """Resend the due deliveries whose job is gone: RQ no longer holds it (Redis lost it, a
    scheduled retry whose scheduler is gone), or a worker claimed it and its claim lapsed
    (killed mid-delivery; RQ would still call that job "started" for its whole timeout).
    Returns how many were resent."""
    now = now or timezone.now()
    busy = _in_flight(OuterRef("subscription_id"), now)
    due = list(
        Delivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now)
        .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
        .exclude(Exists(busy))  # sent when the attempt in flight ends (_send_next)
        .order_by("next_attempt_at")
        .values_list("pk", "next_attempt_at", "claimed_until")[:limit]
    )
    if not due:
        return 0
    lapsed = [pk for pk, _, claimed in due if claimed is not None]
    if lapsed:
        # Cleared, so the next pass asks RQ about the job sent now instead of resending.
        Delivery.objects.filter(pk__in=lapsed, claimed_until__lt=now).update(claimed_until=None)
    unclaimed = [(pk, at) for pk, at, claimed in due if claimed is None]
    overdue = {pk for pk, at in unclaimed if at < now - timedelta(seconds=_OVERDUE_SECONDS)}
    held = deliveries_with_jobs([pk for pk, _ in unclaimed], overdue=overdue)
    missing = lapsed + [pk for pk, _ in unclaimed if pk not in held]
    enqueue_deliveries(missing)
    return len(missing)
