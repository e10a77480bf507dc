"""REST for notification subscriptions (admins): create shows the secret once, nothing
else ever does (answers, audit details, logs); refusals are problem+json."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook

from audit.models import AuditEvent
from notifications.models import Delivery, Notification, Subscription
from notifications.services.delivery import _notification_body
from tests.fixtures.api import problem

pytestmark = pytest.mark.django_db

BASE = "/api/v1/subscriptions"


@pytest.fixture(autouse=True)
def _local_receivers_allowed(settings: Any) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]


WEBHOOK = {
    "name": "pager bridge",
    "target": "operators",
    "event_types": ["approval.requested", "conflict.opened"],
    "channel": "webhook",
    "url": "http://127.0.0.1:9/hooks?token=s3cr3t-token",
}


def _create(api: Any, admin: Any, **changes: Any) -> dict[str, Any]:
    response = api.post(BASE, token=admin.token, body={**WEBHOOK, **changes})
    assert response.status_code == 201, response.content
    body: dict[str, Any] = json.loads(response.content)
    return body


def test_an_admin_creates_a_webhook_and_sees_its_secret_once(api: Any, admin: Any) -> None:
    created = _create(api, admin)
    secret = created["secret"]
    assert secret.startswith("whsec_")
    Webhook(secret)  # a secret the standardwebhooks library accepts
    assert created["url"] == "http://127.0.0.1:9/…"
    assert created["event_types"] == ["approval.requested", "conflict.opened"]
    listed = api.get(BASE, token=admin.token)
    one = api.get(f"{BASE}/{created['id']}", token=admin.token)
    for response in (listed, one):
        assert response.status_code == 200
        text = response.content.decode()
        assert secret not in text and "s3cr3t-token" not in text and 'secret"' not in text
    stored = Subscription.objects.get()
    assert secret not in stored.secret_encrypted and "s3cr3t" not in stored.url_encrypted


def test_secrets_never_reach_the_audit_trail_or_the_logs(
    api: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    created = _create(api, admin)
    rotated = json.loads(
        api.post(f"{BASE}/{created['id']}/rotate-secret", token=admin.token).content
    )
    api.patch(
        f"{BASE}/{created['id']}",
        token=admin.token,
        body={"url": "http://127.0.0.1:9/other?token=an0ther-s3cret"},
    )
    api.post(f"{BASE}/{created['id']}/test", token=admin.token)
    events = AuditEvent.objects.filter(event_type__startswith="notification_subscription.")
    assert sorted(events.values_list("event_type", flat=True)) == [
        "notification_subscription.created",
        "notification_subscription.secret_rotated",
        "notification_subscription.tested",
        "notification_subscription.updated",
    ]
    trail = json.dumps(list(AuditEvent.objects.values_list("details", flat=True)))
    for secret in (created["secret"], rotated["secret"], "s3cr3t-token", "an0ther-s3cret"):
        assert secret not in trail
        assert secret not in caplog.text


def test_rotation_keeps_the_old_secret_signing_during_the_overlap(api: Any, admin: Any) -> None:
    from notifications.services.channels import _webhook_signature
    from notifications.services.delivery import _secrets

    created = _create(api, admin)
    rotated = json.loads(
        api.post(f"{BASE}/{created['id']}/rotate-secret", token=admin.token).content
    )
    assert rotated["secret"] != created["secret"] and rotated["secret_rotating_until"]
    api.post(f"{BASE}/{created['id']}/test", token=admin.token)
    delivery = Delivery.objects.select_related("notification", "subscription").get()
    from django.utils import timezone

    now = timezone.now()
    body = _notification_body(delivery.notification)
    headers = {
        "webhook-id": delivery.webhook_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": _webhook_signature(
            _secrets(delivery.subscription, now),
            webhook_id=delivery.webhook_id,
            timestamp=now,
            body=body,
        ),
    }
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (created["secret"], rotated["secret"]):
        assert Webhook(secret).verify(body, headers)["type"] == "test"


def test_operators_and_outsiders_are_refused(api: Any, operator: Any, outsider: Any) -> None:
    for person in (operator, outsider):
        problem(api.get(BASE, token=person.token), 403, "forbidden")
        problem(api.post(BASE, token=person.token, body=WEBHOOK), 403, "forbidden")
    problem(api.get(BASE), 401, "unauthenticated")
    assert not Subscription.objects.exists()


def test_bad_input_is_a_clear_422_and_writes_nothing(api: Any, admin: Any) -> None:
    for changes in (
        {"channel": "carrier-pigeon"},
        {"event_types": ["approval.maybe"]},
        {"target": "no spaces allowed"},
        {"url": ""},
        {"url": "ftp://127.0.0.1/x"},
        {"channel": "apprise", "url": "json://127.0.0.1/x"},
        {"channel": "email", "url": "http://127.0.0.1/x"},
    ):
        body = problem(
            api.post(BASE, token=admin.token, body={**WEBHOOK, **changes}), 422, "validation_error"
        )
        assert body["detail"], changes
    assert not Subscription.objects.exists()
    assert not AuditEvent.objects.filter(event_type__startswith="notification_").exists()


def test_pause_delete_and_the_delivery_log(api: Any, admin: Any) -> None:
    created = _create(api, admin)
    path = f"{BASE}/{created['id']}"
    paused = api.patch(path, token=admin.token, body={"paused": True})
    assert paused.status_code == 200 and json.loads(paused.content)["paused"] is True
    again = api.patch(path, token=admin.token, body={"paused": True})
    assert again.status_code == 200
    assert AuditEvent.objects.filter(event_type="notification_subscription.updated").count() == 1
    tested = api.post(f"{path}/test", token=admin.token)
    assert tested.status_code == 202
    delivery = json.loads(tested.content)
    assert delivery["event"] == "test" and delivery["status"] == "pending"
    log = json.loads(
        api.get(
            f"/api/v1/deliveries?subscription={created['id']}&event=test", token=admin.token
        ).content
    )
    assert [item["id"] for item in log["items"]] == [delivery["id"]]
    none = json.loads(api.get("/api/v1/deliveries?status=failed", token=admin.token).content)
    assert none["items"] == []
    assert api.delete(path, token=admin.token).status_code == 204
    problem(api.delete(path, token=admin.token), 404, "not_found")
    assert AuditEvent.objects.filter(event_type="notification_subscription.deleted").count() == 1
    assert not Notification.objects.filter(deliveries__isnull=False).exists()


def test_email_and_apprise_subscriptions_are_accepted(api: Any, admin: Any) -> None:
    email = _create(api, admin, channel="email", url="", target="operators")
    assert email["secret"] is None and email["url"] == ""
    chat = _create(api, admin, channel="apprise", url="ntfys://ntfy.example.org/airlock-topic")
    assert chat["secret"] is None and chat["url"] == "ntfys://ntfy.example.org/…"


def test_only_a_webhook_has_a_secret_to_rotate(api: Any, admin: Any) -> None:
    email = _create(api, admin, channel="email", url="", target="operators")
    problem(
        api.post(f"{BASE}/{email['id']}/rotate-secret", token=admin.token),
        409,
        "invalid_transition",
    )
    problem(api.post(f"{BASE}/999999/rotate-secret", token=admin.token), 404, "not_found")


def test_check_deploy_warns_when_the_notify_key_is_derived(tmp_path: Any) -> None:
    import secrets

    from tests.test_settings_deploy import PRODUCTION, check_deploy, subprocess_env

    env = subprocess_env(**PRODUCTION, SECRET_KEY=secrets.token_urlsafe(60))
    env.pop("AIRLOCK_NOTIFY_KEY")
    env["AIRLOCK_DATA_DIR"] = str(tmp_path)
    result = check_deploy(env)
    assert result.returncode != 0
    assert "notifications.W001" in result.stdout + result.stderr
