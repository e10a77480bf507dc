"""The Notifications page (admins): add a subscription and see its secret once, the
delivery log as a fragment that polls, the buttons, and who may open it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from audit.models import AuditEvent
from notifications.models import Delivery, Subscription
from tests.fixtures.console import People, client_for

pytestmark = pytest.mark.django_db

HX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture(autouse=True)
def _local_receivers_allowed(settings: Any) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]


FORM = {
    "name": "pager",
    "target": "operators",
    "channel": "webhook",
    "url": "http://127.0.0.1:9/hook?token=pagetoken",
    "event_types": ["approval.requested"],
}


def test_only_admins_open_the_page(people: People) -> None:
    assert client_for(people.admin).get("/notifications/").status_code == 200
    for person in (people.operator, people.auditor, people.outsider):
        assert client_for(person).get("/notifications/").status_code == 403
        assert client_for(person).post("/notifications/new/", FORM).status_code == 403
    assert not Subscription.objects.exists()


def test_an_admin_adds_a_webhook_and_sees_the_secret_once(people: People) -> None:
    client = client_for(people.admin)
    response = client.post("/notifications/new/", FORM, **HX)
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html
    assert response["Cache-Control"] == "no-store"
    secret = re.search(r'id="new-secret-value">(whsec_[^<]+)<', html)
    assert secret, html
    page = client.get("/notifications/").content.decode()
    assert secret.group(1) not in page and "pagetoken" not in page
    assert "http://127.0.0.1:9/…" in page
    assert AuditEvent.objects.filter(event_type="notification_subscription.created").count() == 1


def test_a_refused_address_is_shown_on_the_form(people: People, settings: Any) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = []
    response = client_for(people.admin).post("/notifications/new/", FORM, **HX)
    assert response.status_code == 422
    assert "loopback" in response.content.decode()
    assert not Subscription.objects.exists()


def test_a_test_event_appears_in_the_polled_log(people: People) -> None:
    client = client_for(people.admin)
    client.post("/notifications/new/", FORM, **HX)
    subscription = Subscription.objects.get()
    response = client.post(f"/notifications/{subscription.pk}/test/", **HX)
    assert response.status_code == 200 and "notifications-changed" in response["HX-Trigger"]
    log = client.get("/notifications/log/", **HX)
    html = log.content.decode()
    assert "<html" not in html and 'id="delivery-log"' in html
    delivery = Delivery.objects.get()
    assert f'id="delivery-{delivery.pk}"' in html and delivery.webhook_id in html


def test_pause_resume_rotate_and_delete(people: People) -> None:
    client = client_for(people.admin)
    client.post("/notifications/new/", FORM, **HX)
    pk = Subscription.objects.get().pk
    client.post(f"/notifications/{pk}/pause/", **HX)
    assert Subscription.objects.get().paused
    client.post(f"/notifications/{pk}/resume/", **HX)
    assert not Subscription.objects.get().paused
    rotated = client.post(f"/notifications/{pk}/rotate/", **HX).content.decode()
    assert "whsec_" in rotated
    assert client.post(f"/notifications/{pk}/explode/", **HX).status_code == 404
    client.post(f"/notifications/{pk}/delete/", **HX)
    assert not Subscription.objects.exists()


def test_metrics_count_deliveries_by_channel_and_outcome(
    people: People, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datetime import timedelta

    from django.test import Client
    from django.utils import timezone

    from notifications import selectors

    monkeypatch.setattr(selectors, "_metrics_cache", None)
    client = client_for(people.admin)
    client.post("/notifications/new/", FORM, **HX)
    pk = Subscription.objects.get().pk
    client.post(f"/notifications/{pk}/test/", **HX)
    Delivery.objects.update(created_at=timezone.now() - timedelta(seconds=90))
    text = Client().get("/metrics").content.decode()
    assert 'airlock_notification_deliveries{channel="webhook",status="pending"} 1' in text
    assert 'airlock_notification_deliveries{channel="email",status="delivered"} 0' in text
    oldest = next(
        line
        for line in text.splitlines()
        if line.startswith("airlock_notification_oldest_pending_seconds ")
    )
    assert float(oldest.split()[1]) >= 90
    assert "airlock_notification_attempt_latency_seconds_count 0" in text
    # Nothing has read the audit chain yet (no notify worker here): the gauge says how far
    # behind it is, and 0 once a pass has read it.
    unread = "airlock_notification_unread_audit_events "
    assert int(next(line for line in text.splitlines() if line.startswith(unread)).split()[1]) > 0
    from notifications.services.dispatch import notifications_dispatch_all

    notifications_dispatch_all()
    monkeypatch.setattr(selectors, "_metrics_cache", None)
    assert f"{unread}0" in Client().get("/metrics").content.decode().splitlines()


def test_a_person_sees_what_reaches_them(people: People) -> None:
    from audit.services import Actor
    from notifications.services.subscriptions import subscription_create

    admin = Actor.person(people.admin)
    for name, target, channel in (
        ("all hands", "*", "email"),
        ("operators' pager", "operators", "webhook"),
        ("release desk", "release-owners", "email"),
    ):
        subscription_create(
            actor=admin,
            name=name,
            target=target,
            channel=channel,
            url="http://127.0.0.1:9/h" if channel == "webhook" else "",
        )
    page = client_for(people.operator).get("/notifications/mine/").content.decode()
    assert "all hands" in page and "operators&#x27; pager" in page
    assert "release desk" not in page
    assert "no email address on file" in page
    nav = client_for(people.operator).get("/").content.decode()
    assert 'href="/notifications/mine/"' in nav
