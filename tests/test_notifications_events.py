"""Which events become notifications, read from the committed audit chain after a cursor
(each once, none on the event's own transaction), who hears what (group, type, kind,
prefix), email to the group's active members, reminders at shares of the TTL and the
escalation, with time passed as `now`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core import mail
from django.db import transaction
from django.utils import timezone

from approvals.models import Approval
from approvals.services.decisions import approval_decide, approval_expire_due
from audit.services import Actor, audit_append, audit_deferred
from console.services import kill_switch_set
from notifications.models import Delivery, DispatchCursor, Notification
from notifications.services import events
from notifications.services.delivery import delivery_attempt
from notifications.services.dispatch import notifications_dispatch, notifications_dispatch_all
from notifications.services.periodic import notifications_tick
from notifications.services.subscriptions import subscription_create
from ownership.models import ConflictClass

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(engine_world: Any) -> Actor:
    return Actor.person(engine_world.person("adele", "admins"))


def _subscribe(admin: Actor, **fields: Any) -> Any:
    fields.setdefault("name", "mail the team")
    fields.setdefault("channel", "email")
    return subscription_create(actor=admin, **fields).subscription


def _types() -> list[str]:
    return list(Notification.objects.order_by("audit_seq").values_list("type", flat=True))


def told() -> int:
    """What the notify worker's reader of the audit chain does a few times a second: read
    the events committed since its cursor and write their notifications. The number read."""
    return notifications_dispatch_all()


def test_a_notifiable_event_costs_its_transaction_nothing_but_the_append(
    engine_world: Any, admin: Actor, django_assert_num_queries: Any
) -> None:
    """Subscribed or not, the event's own transaction writes the audit row and nothing
    else: the notification is written by the chain's reader, after the commit."""
    _subscribe(admin, target="operators")
    with django_assert_num_queries(1):
        audit_append(event_type="kill_switch.engaged", actor=Actor.system(), resource="*")
    assert not Notification.objects.exists()
    assert told() == 1
    assert Notification.objects.get().type == "kill_switch.engaged"


def test_each_event_is_told_once_whatever_reads_it_and_however_often(
    engine_world: Any, admin: Actor
) -> None:
    _subscribe(admin, target="operators")
    for reason in ("one", "two"):
        kill_switch_set(
            scope="*", engaged=reason == "one", reason=reason, actor=Actor.system("tests")
        )
    first = notifications_dispatch(limit=1)  # a full batch: the cursor stops at its event
    assert (first.read, first.told) == (1, 1)
    assert notifications_tick()["read"] == 1  # the cron's tick reads the rest
    assert notifications_dispatch().read == 0 and told() == 0  # nothing twice
    # A cursor set back (a restored backup) reads the events again and tells none twice.
    DispatchCursor.objects.update(audit_seq=0)
    assert told() >= 2
    assert sorted(_types()) == ["kill_switch.engaged", "kill_switch.released"]
    assert Delivery.objects.count() == 2


def test_a_subscription_hears_what_is_read_after_it_exists(engine_world: Any, admin: Actor) -> None:
    kill_switch_set(scope="*", engaged=True, reason="before", actor=Actor.system("tests"))
    assert told() == 1 and not Notification.objects.exists()  # read: nobody listened
    _subscribe(admin, target="operators")
    kill_switch_set(scope="*", engaged=False, reason="after", actor=Actor.system("tests"))
    assert told() == 1 and _types() == ["kill_switch.released"]


def test_a_rolled_back_event_is_never_told(engine_world: Any, admin: Actor) -> None:
    _subscribe(admin, target="operators")
    with pytest.raises(RuntimeError), transaction.atomic():
        kill_switch_set(
            scope="*", engaged=True, reason="drill", actor=Actor.person(engine_world.operator)
        )
        raise RuntimeError("the caller fails after the event")
    assert told() == 0
    assert not Notification.objects.exists() and not Delivery.objects.exists()


def test_an_event_that_cannot_be_told_holds_back_neither_its_change_nor_the_next_events(
    engine_world: Any, admin: Actor, monkeypatch: pytest.MonkeyPatch
) -> None:
    _subscribe(admin, target="operators")
    real_facts = events._facts
    calls: list[str] = []

    def broken_once(event: Any, kind: str) -> Any:
        calls.append(kind)
        if kind == "kill_switch.engaged":
            raise ValueError("a bug in the notifications")
        return real_facts(event, kind)

    monkeypatch.setattr(events, "_facts", broken_once)
    switch = kill_switch_set(
        scope="*", engaged=True, reason="drill", actor=Actor.person(engine_world.operator)
    )
    kill_switch_set(scope="*", engaged=False, reason="over", actor=Actor.system("tests"))
    assert switch.engaged  # the change never depended on its notification
    assert notifications_dispatch().read == 2
    assert calls == ["kill_switch.engaged", "kill_switch.released"]
    assert _types() == ["kill_switch.released"]  # the one after it was told


def test_events_held_by_audit_deferred_are_told_once_appended(
    engine_world: Any, admin: Actor
) -> None:
    _subscribe(admin, target="operators")
    with transaction.atomic(), audit_deferred():
        audit_append(
            event_type="kill_switch.engaged",
            actor=Actor.system(),
            resource="*",
            details={"scope": "*", "reason": "r"},
        )
        assert told() == 0
    assert told() == 1
    notification = Notification.objects.get()
    assert notification.type == "kill_switch.engaged" and notification.audit_seq


def test_subscriptions_filter_by_group_type_kind_and_prefix(
    engine_world: Any, policy: Any, admin: Actor
) -> None:
    hears = [
        _subscribe(admin, name="operators", target="operators"),
        _subscribe(admin, name="everyone", target="*", event_types=["approval.requested"]),
        _subscribe(admin, name="kind", kind="notification-policy", name_prefix="prod-"),
    ]
    deaf = [
        _subscribe(admin, name="other group", target="release-owners"),
        _subscribe(admin, name="other type", event_types=["conflict.opened"]),
        _subscribe(admin, name="other kind", kind="dns-record"),
        _subscribe(admin, name="other prefix", name_prefix="staging-"),
        _subscribe(admin, name="paused", paused=True),
    ]
    action = engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    told()
    notification = Notification.objects.get()
    assert notification.type == "approval.requested"
    assert set(Delivery.objects.values_list("subscription_id", flat=True)) == {s.pk for s in hears}
    assert deaf
    data = notification.data
    assert data["action"] == str(action.pk) and data["kind"] == "notification-policy"
    assert data["name"] == "prod-alerts" and "operators" in notification.audience


def test_email_reaches_the_groups_active_members_with_the_deep_link(
    engine_world: Any, policy: Any, admin: Actor, settings: Any
) -> None:
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.AIRLOCK_PUBLIC_URL = "https://airlock.example.org"
    User.objects.filter(pk=engine_world.operator.pk).update(email="ana@example.org")
    User.objects.filter(pk=engine_world.operator2.pk).update(
        email="bruno@example.org", is_active=False
    )
    outsider = User.objects.create_user(username="zed", email="zed@example.org")
    outsider.groups.add(Group.objects.get(name="owners"))
    _subscribe(admin, target="operators", event_types=["approval.requested"])
    action = engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    told()
    approval = Approval.objects.get(action=action)
    assert delivery_attempt(delivery_id=Delivery.objects.get().pk) == "delivered"
    assert [message.to for message in mail.outbox] == [["ana@example.org"]]
    body = mail.outbox[0].body
    assert f"https://airlock.example.org/approvals/#approval-{approval.pk}" in body
    assert "/decision" not in body  # never a link that acts


def test_a_decision_and_a_conflict_are_told_with_their_pages(
    engine_world: Any, engine_redis: Any, admin: Actor
) -> None:
    _subscribe(admin, target="operators", event_types=["approval.decided", "conflict.opened"])
    conflicted = engine_world.collide(
        engine_world.kind("notification-policy"),
        "prod-alerts",
        {"severity": "critical"},
        {"severity": "low"},
    )
    told()
    decided, opened = Notification.objects.order_by("audit_seq")
    assert decided.type == "approval.decided" and decided.data["decision"] == "approved"
    assert decided.data["link"].endswith(f"/actions/{conflicted.pk}/")
    assert opened.type == "conflict.opened"
    assert opened.data["link"].endswith(f"/conflicts/{opened.data['conflict']}/")
    assert "operators" in opened.audience


def test_reminders_fire_at_the_configured_shares_once_each(
    engine_world: Any, policy: Any, admin: Actor, settings: Any
) -> None:
    settings.AIRLOCK_NOTIFY_REMINDER_SHARES = [0.5, 0.9]
    _subscribe(admin, target="operators", event_types=["approval.reminder"])
    action = engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    told()
    approval = Approval.objects.get(action=action)
    ttl = approval.expires_at - approval.created_at
    assert notifications_tick(now=approval.created_at + ttl * 0.4)["reminders"] == 0
    assert notifications_tick(now=approval.created_at + ttl * 0.55)["reminders"] == 1
    assert notifications_tick(now=approval.created_at + ttl * 0.6)["reminders"] == 0
    assert notifications_tick(now=approval.created_at + ttl * 0.95)["reminders"] == 1
    assert notifications_tick(now=approval.expires_at + timedelta(seconds=1))["reminders"] == 0
    reminders = Notification.objects.filter(type="approval.reminder").order_by("created_at")
    assert [n.data["share"] for n in reminders] == [0.5, 0.9]
    assert reminders[0].data["approval"] == str(approval.pk)
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    assert notifications_tick(now=approval.created_at + ttl * 0.99)["reminders"] == 0


def test_an_escalation_reaches_the_escalation_group(
    engine_world: Any, policy: Any, admin: Actor
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(
        escalation_seconds=60, escalation_group="owners"
    )
    owners = _subscribe(admin, name="owners", target="owners")
    _subscribe(admin, name="release", target="release-owners")
    engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    told()
    assert not Delivery.objects.filter(subscription=owners).exists()
    assert approval_expire_due(now=timezone.now() + timedelta(seconds=61))["escalated"] == 1
    told()
    escalated = Notification.objects.get(type="approval.escalated")
    assert escalated.data["escalation_group"] == "owners"
    assert list(
        Delivery.objects.filter(notification=escalated).values_list("subscription_id", flat=True)
    ) == [owners.pk]


def test_a_broken_audit_chain_is_told_once(engine_world: Any, admin: Actor) -> None:
    from django.db import connection

    from audit.services import audit_chain_verify
    from notifications.services.periodic import notifications_each_minute
    from tests.fixtures.audit import forget_verification

    forget_verification()
    try:
        _subscribe(admin, name="auditors", target="auditors", event_types=["audit.verify_failed"])
        for n in range(3):
            audit_append(event_type="test.event", actor=Actor.system("tests"), details={"n": n})
        assert notifications_each_minute() == {"verify_failed": 0}
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE audit_auditevent SET details = '{\"forged\": true}' "
                "WHERE seq = (SELECT max(seq) - 1 FROM audit_auditevent)"
            )
        assert not audit_chain_verify().ok
        assert notifications_each_minute() == {"verify_failed": 1}
        assert notifications_each_minute() == {"verify_failed": 0}
        told = Notification.objects.get(type="audit.verify_failed")
        assert told.data["first_bad_seq"] and told.data["link"].endswith("/audit/")
        assert "auditors" in told.audience
    finally:
        forget_verification()


def test_the_notifications_cron_schedules_its_passes(redis_client: Any) -> None:
    from rq.cron import CronScheduler

    from notifications.jobs import notifications_each_minute_job, notifications_tick_job

    scheduler = CronScheduler(connection=redis_client)
    scheduler.load_config_from_file("notifications.cron")
    scheduled = {job.func for job in scheduler.get_jobs()}
    assert {notifications_tick_job, notifications_each_minute_job} <= scheduled


def test_the_deep_link_opens_the_card_after_sign_in(
    engine_world: Any, policy: Any, admin: Actor, settings: Any
) -> None:
    from urllib.parse import urlsplit

    from django.test import Client

    settings.AIRLOCK_PUBLIC_URL = "https://airlock.example.org"
    _subscribe(admin, target="operators", event_types=["approval.requested"])
    action = engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    told()
    approval = Approval.objects.get(action=action)
    link = urlsplit(Notification.objects.get().data["link"])
    assert (link.scheme, link.netloc, link.path) == ("https", "airlock.example.org", "/approvals/")
    assert link.fragment == f"approval-{approval.pk}"
    anonymous = Client().get(link.path)
    assert anonymous.status_code == 302
    assert anonymous["Location"].startswith("/login/?next=/approvals/")
    operator = Client()
    operator.force_login(engine_world.operator)
    page = operator.get(link.path).content.decode()
    assert f'id="approval-{approval.pk}"' in page


def test_run_approvals_failures_unknown_outcomes_and_compensated_plans_are_told(
    engine_world: Any, policy: Any, admin: Actor
) -> None:
    from approvals.services.approval_open import approval_open_for_run
    from engine.core.action_audit import audit_action_event

    _subscribe(admin, target="operators")
    owners = _subscribe(admin, name="owners", target="owners")
    with transaction.atomic():
        run_approval = approval_open_for_run(run=engine_world.run)
    action = engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    told()
    worker = Actor.system("worker")
    with transaction.atomic():
        audit_action_event(
            action, event_type="action.failed", actor=worker, details={"reason": "target said 500"}
        )
        audit_action_event(
            action,
            event_type="write.unknown",
            actor=worker,
            details={"error": "timeout after send"},
        )
        audit_append(
            event_type="plan.ended", actor=worker, details={"plan": "p1", "status": "applied"}
        )
        audit_append(
            event_type="plan.ended", actor=worker, details={"plan": "p2", "status": "compensated"}
        )
    notifications_dispatch_all()
    notified = {n.type: n for n in Notification.objects.all()}
    assert set(notified) == {
        "approval.requested",
        "action.failed",
        "action.unknown",
        "plan.compensated",
    }
    requested = [
        n
        for n in Notification.objects.filter(type="approval.requested")
        if n.data["subject"] == "run"
    ]
    assert requested[0].data["approval"] == str(run_approval.pk)
    assert notified["action.failed"].data["error"] == "target said 500"
    assert notified["action.failed"].data["link"].endswith(f"/actions/{action.pk}/")
    assert notified["action.unknown"].data["error"] == "timeout after send"
    assert "owners" in notified["action.failed"].audience  # the kind's owner group
    assert Delivery.objects.filter(subscription=owners).count() == 2  # failed and unknown
    assert notified["plan.compensated"].data["plan"] == "p2"
