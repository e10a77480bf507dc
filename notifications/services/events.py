"""Which audit events become notifications, what they carry, and who hears them.

The audit chain's reader (notifications/services/dispatch.py) calls `event_notify` for each
committed event of AUDIT_TO_NOTIFICATION's types: it reads the event's subject, writes the
Notification and one Delivery per matching subscription, and enqueues the deliveries after
its pass commits. The periodic pass (reminders, a broken chain) and an admin's test event
write theirs through `notification_record` too.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from approvals.models import Action, ApprovalSubject
from audit.models import AuditEvent
from console.permissions import ROLE_ADMIN, ROLE_AUDITOR, ROLE_OPERATOR, resolver_group
from notifications.models import EVERYONE, Subscription
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


@dataclass(frozen=True)
class Listener:
    """What matching needs of a subscription (read in one light statement per event)."""

    id: int
    target: str
    event_types: list[str]
    kind: str
    name_prefix: str

    @classmethod
    def of(cls, subscription: Subscription) -> Listener:
        return cls(
            subscription.pk,
            subscription.target,
            list(subscription.event_types or []),
            subscription.kind,
            subscription.name_prefix,
        )


# Raw statements: the chain's reader runs them for every event it tells, and the ORM's query
# building cost more than the queries themselves.
_LISTENERS = """
SELECT id, target, event_types, kind, name_prefix FROM notifications_subscription
 WHERE NOT paused AND disabled_at IS NULL
"""
_RECORD = """
WITH notification AS (
    INSERT INTO notifications_notification
        (id, type, created_at, data, audit_seq, audience, dedupe_key)
    VALUES (%s, %s, %s, %s::jsonb, %s::bigint, %s::jsonb, %s::varchar)
    ON CONFLICT (dedupe_key) DO NOTHING
    RETURNING id
)
INSERT INTO notifications_delivery (id, notification_id, subscription_id, webhook_id, status,
    attempts, created_at, next_attempt_at, last_error)
SELECT gen_random_uuid(), notification.id, listener.id, %s, 'pending', 0, %s, %s, ''
  FROM notification, unnest(%s::bigint[]) AS listener(id)
RETURNING id
"""


def subscriptions_active() -> list[Listener]:
    """The subscriptions that can hear anything (not paused, not disabled): one statement
    on a small table, read once per pass of the chain's reader."""
    with connection.cursor() as cursor:
        cursor.execute(_LISTENERS)
        rows = cursor.fetchall()
    return [
        Listener(int(pk), target, _json_list(types), kind, prefix)
        for pk, target, types, kind, prefix in rows
    ]


def _json_list(value: Any) -> list[str]:
    loaded = json.loads(value) if isinstance(value, str) else value
    return [str(item) for item in loaded or []]


def _subscription_hears(listener: Listener, facts: Facts) -> bool:
    """Does the subscription want this notification (type, target group, kind, prefix)?"""
    if listener.event_types and facts.type not in listener.event_types:
        return False
    if listener.target != EVERYONE and listener.target not in facts.audience:
        return False
    if listener.kind and facts.data.get("kind") != listener.kind:
        return False
    name = str(facts.data.get("name") or "")
    return not (listener.name_prefix and not name.startswith(listener.name_prefix))


def _hears_type(listener: Listener, kind: str) -> bool:
    return not listener.event_types or kind in listener.event_types


def event_notify(event: AuditEvent, listeners: Iterable[Listener]) -> bool:
    """Write the notification of one committed audit event for the subscriptions among
    `listeners` that hear it (the chain's reader calls this, in its pass's transaction).
    False when there is nothing to tell. A failure is logged and rolled back to a savepoint:
    one event that cannot be told never holds back the ones after it."""
    kind = AUDIT_TO_NOTIFICATION.get(event.event_type)
    if kind is None or (kind == "plan.compensated" and _plan_status(event) not in _COMPENSATED):
        return False
    listening = [listener for listener in listeners if _hears_type(listener, kind)]
    if not listening:
        return False
    try:
        with transaction.atomic():
            facts = _facts(event, kind)
            recorded = notification_record(
                facts, listening, audit_seq=event.seq or None, dedupe_key=f"audit:{event.seq}"
            )
    except Exception:
        log.exception("could not record the %s notification of audit event %s", kind, event.seq)
        return False
    return recorded is not None


def notification_record(
    facts: Facts,
    listeners: Iterable[Listener],
    *,
    audit_seq: int | None = None,
    dedupe_key: str | None = None,
    matched: bool = False,
) -> uuid.UUID | None:
    """Store the notification and a pending Delivery per subscription that hears it (all
    of `listeners` when `matched`) in one statement, in the caller's transaction; the
    deliveries are enqueued after commit. Returns the notification's id; None when no
    subscription hears it or `dedupe_key` is taken (told before): nothing stored."""
    hearing = [item.id for item in listeners if matched or _subscription_hears(item, facts)]
    if not hearing:
        return None
    now = timezone.now()
    notification_id = uuid.uuid4()
    params: list[Any] = [
        notification_id,
        facts.type,
        now,
        json.dumps(facts.data, default=str),
        audit_seq,
        json.dumps(sorted(facts.audience)),
        dedupe_key,
        f"msg_{notification_id.hex}",
        now,
        now,
        hearing,
    ]
    with connection.cursor() as cursor:
        cursor.execute(_RECORD, params)
        ids = [row[0] for row in cursor.fetchall()]
    if not ids:
        return None
    transaction.on_commit(lambda: enqueue_deliveries(ids))
    return notification_id


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


@dataclass(frozen=True)
class ApprovalRow:
    """What a notification says about an approval, read in one statement."""

    id: uuid.UUID
    subject: str
    run_id: uuid.UUID
    plan_id: uuid.UUID | None
    action_id: uuid.UUID | None
    expires_at: datetime
    quorum: int
    agent: str
    kind: str | None
    name: str | None
    operation: str | None
    conflict_class: str | None
    resolver: str | None
    escalation_group: str | None
    owner_group: str | None


# One statement (the approval's own row, its run's agent, its action's class and owner
# group): the ORM's select_related of five models cost ~3 ms of Python in the approval's
# transaction, this ~0.2 ms.
_APPROVAL_ROW = """
SELECT ap.id, ap.subject, ap.run_id, ap.plan_id, ap.action_id, ap.expires_at, ap.quorum,
       ag.name, ac.kind_id, ac.name, ac.operation, ac.conflict_class_id,
       cc.resolver, cc.escalation_group, COALESCE(rs.owner_group, rk.owner_group)
  FROM approvals_approval ap
  JOIN approvals_run ru ON ru.id = ap.run_id
  JOIN approvals_agent ag ON ag.id = ru.agent_id
  LEFT JOIN approvals_action ac ON ac.id = ap.action_id
  LEFT JOIN ownership_conflictclass cc ON cc.slug = ac.conflict_class_id
  LEFT JOIN ownership_resource rs ON rs.id = ac.resource_id
  LEFT JOIN ownership_resourcekind rk ON rk.slug = ac.kind_id
 WHERE ap.id = %s
"""


def approval_row(approval_id: uuid.UUID | str) -> ApprovalRow | None:
    """The approval's facts, or None when there is no such approval."""
    try:
        key = approval_id if isinstance(approval_id, uuid.UUID) else uuid.UUID(str(approval_id))
    except ValueError:
        return None
    with connection.cursor() as cursor:
        cursor.execute(_APPROVAL_ROW, [key])
        row = cursor.fetchone()
    return None if row is None else ApprovalRow(*row)


def _approval_facts(
    details: dict[str, Any], data: dict[str, Any], kind: str, event_type: str
) -> set[str]:
    row = approval_row(str(details.get("approval") or ""))
    if row is None:
        return set()
    return approval_facts_into(data, row, kind=kind, event_type=event_type, details=details)


def approval_facts_into(
    data: dict[str, Any],
    approval: ApprovalRow,
    *,
    kind: str,
    event_type: str = "",
    details: dict[str, Any] | None = None,
) -> set[str]:
    """Fill `data` with an approval's facts; the groups it concerns (besides operators,
    who decide approvals): the class's resolver group, or on escalation the class's
    escalation group."""
    details = details or {}
    data.update(
        approval=str(approval.id),
        subject=approval.subject,
        run=str(approval.run_id),
        agent=approval.agent,
        deadline=_iso(approval.expires_at),
        quorum=approval.quorum,
        plan=str(approval.plan_id) if approval.plan_id else None,
        link=deep_link(f"/approvals/#approval-{approval.id}"),
    )
    if event_type in _DECISIONS:
        data["decision"] = _DECISIONS[event_type]
        data["link"] = deep_link(_subject_path(approval))
    groups: set[str] = set()
    if approval.action_id is not None:
        data.update(
            action=str(approval.action_id),
            resource=f"{approval.kind}/{approval.name}",
            kind=approval.kind,
            name=approval.name,
            operation=approval.operation,
            conflict_class=approval.conflict_class,
        )
        groups.add(resolver_group(approval.resolver or "", approval.owner_group or ""))
        if kind == "approval.escalated":
            groups.add(approval.escalation_group or "")
    if kind == "approval.escalated":
        data["escalation_group"] = details.get("escalation_group") or ROLE_OPERATOR
        groups.add(str(details.get("escalation_group") or ""))
    return groups


def _subject_path(approval: ApprovalRow) -> str:
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
