"""Notifications: who hears what (Subscription), what happened (Notification), and the
outbox of one Delivery per subscription per event with every attempt (DeliveryAttempt).

The audit chain is the outbox: an event commits with the change it records, and the
`notify` process reads the chain after its cursor (DispatchCursor) and writes each event's
Notification and Deliveries, advancing the cursor in the same transaction — exactly once, and
nothing on the path of the decision or write that caused it (notifications/services/
dispatch.py). A Delivery stays `pending` until a worker delivers it, the retry window closes,
or its subscription is disabled. Secrets (webhook signing keys, Apprise URLs, webhook URLs) are
stored encrypted (notifications/services/secrets.py) and never leave through the API.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

EVERYONE = "*"


class Channel(models.TextChoices):
    WEBHOOK = "webhook", "Webhook"
    APPRISE = "apprise", "Chat or paging (Apprise)"
    EMAIL = "email", "Email"


class Subscription(models.Model):
    """Who hears what: a target (a group's name, or `*` for everyone), the event types
    (empty: every type), an optional resource kind and name prefix, and one channel."""

    name = models.CharField(max_length=100)
    target = models.CharField(max_length=150, default=EVERYONE)
    event_types = models.JSONField(default=list, blank=True)
    kind = models.CharField(max_length=64, blank=True)
    name_prefix = models.CharField(max_length=255, blank=True)
    channel = models.CharField(max_length=16, choices=Channel.choices)
    # Encrypted (Fernet): the webhook or Apprise URL, and the webhook's signing secret.
    url_encrypted = models.TextField(blank=True)
    # What may be shown of the URL: scheme and host only (an Apprise URL's tokens, a
    # webhook URL's path and query can be credentials).
    url_display = models.CharField(max_length=300, blank=True)
    secret_encrypted = models.TextField(blank=True)
    # The secret a rotation replaced: it keeps signing beside the new one until then.
    previous_secret_encrypted = models.TextField(blank=True)
    previous_secret_until = models.DateTimeField(null=True, blank=True)
    paused = models.BooleanField(default=False)
    # Set when the endpoint answered 410 Gone: no more deliveries until an admin resumes it.
    disabled_at = models.DateTimeField(null=True, blank=True)
    disabled_reason = models.CharField(max_length=300, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        # (No index for the capture hook's query of the live subscriptions: the table is
        # small, and a partial index would need a generic-plan test — test_partial_indexes.)
        constraints = [
            models.CheckConstraint(
                condition=Q(channel__in=["webhook", "apprise", "email"]),
                name="notif_sub_channel_known",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.channel})"


class Notification(models.Model):
    """One event worth telling someone about, as its receivers get it: `type` and `data`
    (ids, resource, run, agent, class, deadline, deep link)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    type = models.CharField(max_length=64)
    created_at = models.DateTimeField()
    data = models.JSONField(default=dict)
    # The audit event that caused it (None for reminders, tests and verification breaks).
    audit_seq = models.BigIntegerField(null=True, blank=True)
    # The groups it concerns (a subscription to one of them hears it).
    audience = models.JSONField(default=list)
    # Events made by a periodic pass (a reminder at a share of a TTL) exist once.
    dedupe_key = models.CharField(max_length=200, null=True, blank=True, unique=True)

    class Meta:
        indexes = [models.Index(fields=["type", "created_at"])]

    def __str__(self) -> str:
        return f"{self.type} {self.id}"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    DELIVERED = "delivered", "Delivered"
    FAILED = "failed", "Failed"
    DISABLED = "disabled", "Disabled"


class Delivery(models.Model):
    """One notification to one subscription. `webhook_id` is the same on every retry, so
    receivers can de-duplicate; a worker claims it (`claimed_until`) before each attempt."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    notification = models.ForeignKey(
        Notification, on_delete=models.CASCADE, related_name="deliveries"
    )
    subscription = models.ForeignKey(
        Subscription, on_delete=models.CASCADE, related_name="deliveries"
    )
    webhook_id = models.CharField(max_length=64)
    status = models.CharField(
        max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    next_attempt_at = models.DateTimeField()
    # A worker's claim: another worker (or the reconciler) leaves the row alone until then.
    claimed_until = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["notification", "subscription"], name="notif_one_delivery_per_sub"
            ),
            models.CheckConstraint(
                condition=Q(status__in=["pending", "delivered", "failed", "disabled"]),
                name="notif_delivery_status_known",
            ),
        ]
        indexes = [
            # The reconciler's scan: pending deliveries by due time.
            # The reconciler's scan of due deliveries: a whole index, not a partial one on
            # status='pending' (its prepared statement's generic plan could not use that).
            models.Index(fields=["status", "next_attempt_at"], name="notif_delivery_due"),
            models.Index(fields=["subscription", "created_at"], name="notif_delivery_by_sub"),
        ]

    def __str__(self) -> str:
        return f"delivery {self.id} ({self.status})"


class DeliveryAttempt(models.Model):
    """One try: the answer's status code (None when none came), latency, the start of the
    answer's body, or the error."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_rows")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    status_code = models.PositiveIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(default=0)
    response_excerpt = models.CharField(max_length=1000, blank=True)
    error = models.CharField(max_length=500, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["delivery", "number"], name="notif_attempt_once")
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of {self.delivery_id}"


class DispatchCursor(models.Model):
    """How far the notifications have read the audit chain: every event up to `audit_seq`
    has been turned into its notification (or found to need none). One row, locked by the
    pass that advances it."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    audit_seq = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"notifications read the audit chain up to #{self.audit_seq}"
