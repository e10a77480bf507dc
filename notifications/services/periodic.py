"""The notifications' periodic pass (notifications/cron.py), computed from PostgreSQL so a
restart loses no timer: the audit chain's reader (a safety net beside the notify worker's
thread), the reconciler, approval reminders at shares of their TTL, and the chain's break.

Time comes from `now` (default django.utils.timezone.now()): tests pass a later `now`
instead of sleeping, as approvals' approval_expire_due does.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import DateTimeField, ExpressionWrapper, F, Value
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus
from audit.services import audit_chain_status
from notifications.models import Notification
from notifications.services.delivery import deliveries_reconcile
from notifications.services.dispatch import notifications_dispatch_all
from notifications.services.events import (
    ApprovalRow,
    Facts,
    approval_facts_into,
    approval_row,
    audience_for,
    deep_link,
    notification_record,
    subscriptions_active,
)

log = logging.getLogger("airlock.notifications")

REMINDER = "approval.reminder"
VERIFY_FAILED = "audit.verify_failed"


def notifications_tick(*, now: datetime | None = None) -> dict[str, int]:
    """The cron's every-few-seconds work. Reading the audit chain is the notify worker's
    own thread's job (notifications/dispatcher.py); the tick reads too, so nothing waits
    on that thread alone."""
    now = now or timezone.now()
    return {
        "read": notifications_dispatch_all(),
        "resent": deliveries_reconcile(now=now),
        "reminders": _approval_reminders_due(now=now),
    }


def notifications_each_minute() -> dict[str, int]:
    """The cron's every-minute work: a break of the audit chain (read from the shared checkpoint
    that audit's own periodic walk keeps; this walks only the events since)."""
    return {"verify_failed": _audit_break_notify()}


def _listening(kind: str) -> list[object]:
    return [s for s in subscriptions_active() if not s.event_types or kind in s.event_types]


def _approval_reminders_due(*, now: datetime | None = None, limit: int = 500) -> int:
    """A reminder per pending approval per configured share of its TTL now passed
    (AIRLOCK_NOTIFY_REMINDER_SHARES), once: the notification's dedupe key is unique.
    Nothing is read past one query while no subscription hears reminders."""
    now = now or timezone.now()
    if not _listening(REMINDER):
        return 0
    sent = 0
    for share in sorted(settings.AIRLOCK_NOTIFY_REMINDER_SHARES):
        # created_at + share * (expires_at - created_at) <= now < expires_at
        at_share = ExpressionWrapper(
            F("created_at") + (F("expires_at") - F("created_at")) * Value(share),
            output_field=DateTimeField(),
        )
        due = list(
            Approval.objects.filter(status=ApprovalStatus.PENDING, expires_at__gt=now)
            .alias(remind_at=at_share)
            .filter(remind_at__lte=now)
            .order_by("expires_at")
            .values_list("pk", flat=True)[:limit]
        )
        keys = {pk: f"{REMINDER}:{pk}:{share:g}" for pk in due}
        done = set(
            Notification.objects.filter(dedupe_key__in=keys.values()).values_list(
                "dedupe_key", flat=True
            )
        )
        for pk in due:
            approval = approval_row(pk) if keys[pk] not in done else None
            if approval is not None and _remind(approval, share, keys[pk]):
                sent += 1
    return sent


def _remind(approval: ApprovalRow, share: float, key: str) -> bool:
    data: dict[str, object] = {"event": REMINDER, "share": share}
    audience = {"operators"} | approval_facts_into(data, approval, kind=REMINDER)
    facts = Facts(REMINDER, data, frozenset(group for group in audience if group))
    try:
        with transaction.atomic():
            return notification_record(facts, subscriptions_active(), dedupe_key=key) is not None
    except IntegrityError:  # another pass sent it first
        return False


def _audit_break_notify() -> int:
    """Tell of a broken audit chain once per break (its first bad seq and head)."""
    status = audit_chain_status()
    if status.ok or not _listening(VERIFY_FAILED):
        return 0
    facts = Facts(
        VERIFY_FAILED,
        {
            "event": VERIFY_FAILED,
            "first_bad_seq": status.first_bad_seq,
            "problem": status.problem,
            "checked_at": status.checked_at.isoformat(),
            "link": deep_link("/audit/"),
        },
        audience_for(VERIFY_FAILED),
    )
    key = f"{VERIFY_FAILED}:{status.first_bad_seq}:{status.head_hash[:16]}"
    try:
        with transaction.atomic():
            recorded = notification_record(facts, subscriptions_active(), dedupe_key=key)
    except IntegrityError:
        return 0
    return 1 if recorded is not None else 0
