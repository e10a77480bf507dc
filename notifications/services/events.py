"""Which audit events become notifications, what they carry, and who hears them.

`notification_capture` runs inside the transaction that appended the audit event (the
audit app calls it: notifications/apps.py registers it for AUDIT_TO_NOTIFICATION's types
only, so every other event costs the audit append one set lookup). With no subscription
that could hear the type it costs one indexed query; otherwise it reads the event's
subject, writes the Notification and one Delivery per matching subscription — the outbox
rows commit or roll back with the event — and enqueues the deliveries after commit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from approvals.models import Action, Approval, ApprovalSubject
from audit.models import AuditEvent
from console.permissions import ROLE_ADMIN, ROLE_AUDITOR, ROLE_OPERATOR, resolver_group
from notifications.models import EVERYONE, Delivery, Notification, Subscription
from notifications.outbox import enqueue_deliveries
from ownership.models import Conflict

log = logging.getLogger("airlock.notifications")

# audit event type -> notification type (plan.ended only when it ended compensated).
AUDIT_TO_NOTIFICATION: dict[str, str] = {
    "approval.requested": "approval.requested",
    "approval.approved": "approval.decided",
    "approval.rejected": "approval.decided",
    "approval.expired": "approval.decided",
    "approval.escalated": "approval.escalated",
    "conflict.opened": "conflict.opened",
    "conflict.reopened": "conflict.opened",
    "conflict.resolved": "conflict.resolved",
    "action.failed": "action.failed",
    "write.unknown": "action.unknown",
    "plan.ended": "plan.compensated",
    "kill_switch.engaged": "kill_switch.engaged",
    "kill_switch.released": "kill_switch.released",
    "notification_subscription.disabled": "subscription.disabled",
}
# Every type a subscription may name: the mapped ones, and those made by the periodic pass
# (notifications/services/periodic.py) or an admin's test.
NOTIFICATION_TYPES: tuple[str, ...] = (
    "approval.requested",
    "approval.reminder",
    "approval.escalated",
    "approval.decided",
    "conflict.opened",
    "conflict.resolved",
    "action.failed",
    "action.unknown",
    "plan.compensated",
    "kill_switch.engaged",
    "kill_switch.released",
    "audit.verify_failed",
    "subscription.disabled",
    "test",
)
_COMPENSATED = frozenset({"compensated", "partially_compensated"})
_DECISIONS = {
    "approval.approved": "approved",
    "approval.rejected": "rejected",
    "approval.expired": "expired",
}


@dataclass(frozen=True)
class Facts:
    """A notification before it is stored: its data (what receivers get) and audience
    (the groups it concerns)."""

    type: str
    data: dict[str, Any]
    audience: frozenset[str]


def deep_link(path: str) -> str:
    """An absolute console URL (AIRLOCK_PUBLIC_URL + path): a page that asks for sign-in
    first, never a link that acts."""
    return f"{settings.AIRLOCK_PUBLIC_URL}{path}"


def subscriptions_active() -> list[Subscription]:
    """The subscriptions that can hear anything (one query, on a partial index)."""
    return list(Subscription.objects.filter(paused=False, disabled_at__isnull=True))


def _subscription_hears(subscription: Subscription, facts: Facts) -> bool:
    """Does `subscription` want this notification (type, target group, kind, prefix)?"""
    if subscription.event_types and facts.type not in subscription.event_types:
        return False
    if subscription.target != EVERYONE and subscription.target not in facts.audience:
        return False
    if subscription.kind and facts.data.get("kind") != subscription.kind:
        return False
    name = str(facts.data.get("name") or "")
    return not (subscription.name_prefix and not name.startswith(subscription.name_prefix))


def _hears_type(subscription: Subscription, kind: str) -> bool:
    return not subscription.event_types or kind in subscription.event_types


def notification_capture(event: AuditEvent) -> None:
    """The audit app's after-append callback (see the module docstring). A failure here is
    logged and rolled back to a savepoint: it never fails the event's own transaction."""
    kind = AUDIT_TO_NOTIFICATION.get(event.event_type)
    if kind is None or (kind == "plan.compensated" and _plan_status(event) not in _COMPENSATED):
        return
    listening = [sub for sub in subscriptions_active() if _hears_type(sub, kind)]
    if not listening:
        return
    try:
        with transaction.atomic():
            facts = _facts(event, kind)
            notification_record(facts, listening, audit_seq=event.seq or None)
    except Exception:
        log.exception("could not record the %s notification of audit event %s", kind, event.seq)


def notification_record(
    facts: Facts,
    subscriptions: Iterable[Subscription],
    *,
    audit_seq: int | None = None,
    dedupe_key: str | None = None,
    matched: bool = False,
) -> Notification | None:
    """Store the notification and a pending Delivery per subscription that hears it (all
    of `subscriptions` when `matched`), in the caller's transaction; the deliveries are
    enqueued after commit. None when no subscription hears it (nothing stored)."""
    hearing = [sub for sub in subscriptions if matched or _subscription_hears(sub, facts)]
    if not hearing:
        return None
    now = timezone.now()
    notification = Notification.objects.create(
        type=facts.type,
        created_at=now,
        data=facts.data,
        audience=sorted(facts.audience),
        audit_seq=audit_seq,
        dedupe_key=dedupe_key,
    )
    webhook_id = f"msg_{notification.id.hex}"
    deliveries = Delivery.objects.bulk_create(
        Delivery(
            notification=notification,
            subscription=sub,
            webhook_id=webhook_id,
            created_at=now,
            next_attempt_at=now,
        )
        for sub in hearing
    )
    ids = [delivery.pk for delivery in deliveries]
    transaction.on_commit(lambda: enqueue_deliveries(ids))
    return notification


def _plan_status(event: AuditEvent) -> str:
    return str((event.details or {}).get("status", ""))


def _split(identifier: str) -> tuple[str, str]:
    kind, _, name = identifier.partition("/")
    return (kind, name) if name else ("", "")


def _facts(event: AuditEvent, kind: str) -> Facts:
    details: dict[str, Any] = dict(event.details or {})
    resource = event.resource or ""
    data: dict[str, Any] = {
        "event": event.event_type,
        "audit_seq": event.seq or None,
        "actor": event.actor_label,
        "resource": resource or None,
        "kind": _split(resource)[0] or None,
        "name": _split(resource)[1] or None,
        "run": str(event.run_id) if event.run_id else None,
        "action": str(event.action_id) if event.action_id else None,
        "link": deep_link("/"),
    }
    audience = {ROLE_OPERATOR}
    if kind.startswith("approval."):
        audience |= _approval_facts(details, data, kind, event.event_type)
    elif kind.startswith("conflict."):
        audience |= _conflict_facts(details, data)
    elif kind in ("action.failed", "action.unknown"):
        audience |= _action_facts(data)
        data["error"] = details.get("reason") or details.get("code") or details.get("error")
    elif kind == "plan.compensated":
        data["plan"] = details.get("plan")
        data["status"] = details.get("status")
        data["link"] = deep_link(f"/plans/{details.get('plan')}/")
    elif kind.startswith("kill_switch."):
        data["scope"] = details.get("scope") or resource
        data["reason"] = details.get("reason", "")
    elif kind == "subscription.disabled":
        audience = {ROLE_ADMIN}
        data["subscription"] = details.get("id")
        data["reason"] = details.get("reason", "")
        data["link"] = deep_link("/notifications/")
    return Facts(kind, data, frozenset(group for group in audience if group))


def _approval_facts(
    details: dict[str, Any], data: dict[str, Any], kind: str, event_type: str
) -> set[str]:
    if not details.get("approval"):
        return set()
    approval = (
        Approval.objects.select_related(
            "run__agent", "action__conflict_class", "action__kind", "action__resource"
        )
        .filter(pk=str(details.get("approval") or ""))
        .first()
    )
    if approval is None:
        return set()
    return approval_facts_into(data, approval, kind=kind, event_type=event_type, details=details)


def approval_facts_into(
    data: dict[str, Any],
    approval: Approval,
    *,
    kind: str,
    event_type: str = "",
    details: dict[str, Any] | None = None,
) -> set[str]:
    """Fill `data` with an approval's facts; the groups it concerns (besides operators,
    who decide approvals): the class's resolver group, or on escalation the class's
    escalation group."""
    details = details or {}
    action = approval.action
    data.update(
        approval=str(approval.pk),
        subject=str(approval.subject),
        run=str(approval.run_id),
        agent=approval.run.agent.name,
        deadline=_iso(approval.expires_at),
        quorum=approval.quorum,
        plan=str(approval.plan_id) if approval.plan_id else None,
        link=deep_link(f"/approvals/#approval-{approval.pk}"),
    )
    if event_type in _DECISIONS:
        data["decision"] = _DECISIONS[event_type]
        data["link"] = deep_link(_subject_path(approval))
    groups: set[str] = set()
    if action is not None:
        data.update(
            action=str(action.pk),
            resource=action.resource_identifier,
            kind=action.kind_id,
            name=action.name,
            operation=action.operation,
            conflict_class=action.conflict_class_id,
        )
        owner = action.resource.owner_group if action.resource else action.kind.owner_group
        groups.add(resolver_group(action.conflict_class.resolver, owner))
        if kind == "approval.escalated":
            groups.add(action.conflict_class.escalation_group)
    if kind == "approval.escalated":
        data["escalation_group"] = details.get("escalation_group") or ROLE_OPERATOR
        groups.add(str(details.get("escalation_group") or ""))
    return groups


def _subject_path(approval: Approval) -> str:
    if approval.subject == ApprovalSubject.ACTION and approval.action_id:
        return f"/actions/{approval.action_id}/"
    if approval.subject == ApprovalSubject.PLAN and approval.plan_id:
        return f"/plans/{approval.plan_id}/"
    return f"/runs/{approval.run_id}/"


def _conflict_facts(details: dict[str, Any], data: dict[str, Any]) -> set[str]:
    if not details.get("conflict"):
        return set()
    conflict = (
        Conflict.objects.select_related("action__run__agent")
        .filter(pk=str(details.get("conflict") or ""))
        .first()
    )
    if conflict is None:
        return set()
    data.update(
        conflict=str(conflict.pk),
        conflict_class=conflict.conflict_class_id,
        agent=conflict.action.run.agent.name,
        resolution=details.get("choice"),
        link=deep_link(f"/conflicts/{conflict.pk}/"),
    )
    return {conflict.resolver_group}


def _action_facts(data: dict[str, Any]) -> set[str]:
    if not data.get("action"):
        return set()
    action = (
        Action.objects.select_related("run__agent", "kind", "resource")
        .filter(pk=str(data.get("action") or ""))
        .first()
    )
    if action is None:
        return set()
    data.update(
        agent=action.run.agent.name,
        operation=action.operation,
        conflict_class=action.conflict_class_id,
        link=deep_link(f"/actions/{action.pk}/"),
    )
    return {action.resource.owner_group if action.resource else action.kind.owner_group}


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def audience_for(kind: str) -> frozenset[str]:
    """The groups of a notification made outside an audit event (periodic pass, test)."""
    if kind == "audit.verify_failed":
        return frozenset({ROLE_OPERATOR, ROLE_ADMIN, ROLE_AUDITOR})
    return frozenset({ROLE_ADMIN})
