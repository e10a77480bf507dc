"""The webhook address guard: every refused range, when a subscription is saved and when
a delivery connects; a name resolving to 127.0.0.1; https only unless allowed; and the
delivery connects to the address that was checked (no DNS-rebinding bypass)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Group, User

from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import ValidationFailed
from notifications.models import Delivery, DeliveryAttempt, Subscription
from notifications.services.delivery import delivery_attempt
from notifications.services.subscriptions import subscription_create, subscription_test
from tests.notify_receiver import Receiver, running_receiver

pytestmark = pytest.mark.django_db

REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.8.9.10", "loopback"),
    ("[::1]", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.5.4", "private"),
    ("192.168.0.10", "private"),
    ("[fd12:3456::1]", "private"),
    ("169.254.10.20", "link-local"),
    ("[fe80::1]", "link-local"),
    ("169.254.169.254", "cloud metadata"),
    ("100.100.100.200", "cloud metadata"),
    ("[fd00:ec2::254]", "cloud metadata"),
    ("224.0.0.251", "multicast"),
    ("[ff02::1]", "multicast"),
    ("100.64.1.1", "shared"),
    ("0.0.0.0", "unspecified"),  # noqa: S104 - the address under test
    ("[::ffff:127.0.0.1]", "loopback"),
    ("240.0.0.1", "reserved"),
]


@pytest.fixture
def admin(db: Any) -> Actor:
    user = User.objects.create_user(username="adele", password=None)
    user.groups.add(Group.objects.get_or_create(name="admins")[0])
    return Actor.person(user)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running_receiver() as server:
        yield server


def _create(admin: Actor, url: str) -> Any:
    return subscription_create(actor=admin, name="hook", channel="webhook", url=url)


@pytest.mark.parametrize(("host", "reason"), REFUSED)
def test_a_refused_address_cannot_be_saved(
    admin: Actor, settings: Any, host: str, reason: str
) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = []
    with pytest.raises(ValidationFailed, match=reason) as refused:
        _create(admin, f"https://{host}/hook")
    assert refused.value.extra["errors"][0]["field"] == "url"
    assert not Subscription.objects.exists()
    assert not AuditEvent.objects.filter(event_type__startswith="notification_").exists()


@pytest.mark.parametrize(("host", "reason"), REFUSED)
def test_a_refused_address_is_not_connected_to_at_delivery(
    admin: Actor, settings: Any, host: str, reason: str
) -> None:
    # Saved while an operator allowed it; the allowance is then withdrawn.
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["0.0.0.0/0", "::/0"]
    created = _create(admin, f"https://{host}/hook")
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = []
    delivery = subscription_test(actor=admin, subscription_id=created.subscription.pk)
    assert delivery_attempt(delivery_id=delivery.pk) == "failed"
    attempt = DeliveryAttempt.objects.get(delivery=delivery)
    assert reason in attempt.error and attempt.status_code is None
    assert Delivery.objects.get(pk=delivery.pk).status == "failed"


def test_a_name_that_resolves_to_loopback_is_refused(admin: Actor, settings: Any) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = []
    with pytest.raises(ValidationFailed, match=r"'localhost' resolves to 127\.0\.0\.1"):
        _create(admin, "https://localhost/hook")


def test_plain_http_needs_the_setting(admin: Actor, settings: Any) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = False
    with pytest.raises(ValidationFailed, match="must be https"):
        _create(admin, "http://127.0.0.1/hook")
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    assert _create(admin, "http://127.0.0.1/hook").secret


def test_a_listed_range_or_host_is_allowed(admin: Actor, settings: Any) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["10.0.0.0/8", "localhost"]
    assert _create(admin, "https://10.20.30.40/hook").secret
    assert _create(admin, "https://localhost/hook").secret
    with pytest.raises(ValidationFailed, match="private"):
        _create(admin, "https://192.168.1.1/hook")


def test_user_info_in_the_url_is_refused(admin: Actor, settings: Any) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    with pytest.raises(ValidationFailed, match="user name or password"):
        _create(admin, "https://bob:pw@127.0.0.1/hook")


def _resolving(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> None:
    """A resolver whose answers the test sets (the DNS, not the database, is faked)."""
    real = socket.getaddrinfo

    def fake(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host in answers:
            address = answers[host].pop(0) if len(answers[host]) > 1 else answers[host][0]
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_a_name_that_rebinds_to_loopback_after_the_save_is_refused_at_delivery(
    admin: Actor, settings: Any, monkeypatch: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = []
    # First answer public (the save), then 127.0.0.1 (the delivery) - where the receiver is.
    _resolving(monkeypatch, {"hooks.rebind.test": ["93.184.216.34", "127.0.0.1"]})
    created = _create(admin, f"http://hooks.rebind.test:{receiver.port}/hook")
    delivery = subscription_test(actor=admin, subscription_id=created.subscription.pk)
    assert delivery_attempt(delivery_id=delivery.pk) == "failed"
    assert "loopback" in DeliveryAttempt.objects.get(delivery=delivery).error
    assert receiver.received == []


def test_a_delivery_connects_to_the_checked_address_with_the_urls_host(
    admin: Actor, settings: Any, monkeypatch: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1/32"]
    _resolving(monkeypatch, {"hooks.example.test": ["127.0.0.1"]})
    created = _create(admin, f"http://hooks.example.test:{receiver.port}/hook?k=v")
    delivery = subscription_test(actor=admin, subscription_id=created.subscription.pk)
    assert delivery_attempt(delivery_id=delivery.pk) == "delivered"
    (request,) = receiver.received
    assert request.headers["host"] == f"hooks.example.test:{receiver.port}"
    assert request.path == "/hook?k=v"


def test_redirects_are_not_followed(admin: Actor, settings: Any, receiver: Receiver) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    receiver.default = (302, {"Location": "http://169.254.169.254/latest/meta-data/"})
    created = _create(admin, receiver.url)
    delivery = subscription_test(actor=admin, subscription_id=created.subscription.pk)
    assert delivery_attempt(delivery_id=delivery.pk) == "retry"
    assert len(receiver.received) == 1
    assert DeliveryAttempt.objects.get(delivery=delivery).status_code == 302


def test_an_apprise_subscription_sends_a_short_text_with_the_deep_link(
    admin: Actor, settings: Any, receiver: Receiver
) -> None:
    settings.AIRLOCK_PUBLIC_URL = "https://airlock.example.org"
    created = subscription_create(
        actor=admin,
        name="ntfy",
        channel="apprise",
        url=f"ntfy://127.0.0.1:{receiver.port}/airlock-approvals",
    )
    assert created.secret == ""
    delivery = subscription_test(actor=admin, subscription_id=created.subscription.pk)
    assert delivery_attempt(delivery_id=delivery.pk) == "delivered"
    (request,) = receiver.received
    text = request.body.decode()
    assert "airlock-approvals" in text  # ntfy's topic
    assert "Airlock: test" in text and "https://airlock.example.org/" in text


def test_apprise_failures_are_retried(admin: Actor, receiver: Receiver) -> None:
    receiver.default = (500, {})
    created = subscription_create(
        actor=admin, name="ntfy", channel="apprise", url=f"ntfy://127.0.0.1:{receiver.port}/x"
    )
    delivery = subscription_test(actor=admin, subscription_id=created.subscription.pk)
    assert delivery_attempt(delivery_id=delivery.pk) == "retry"
    assert DeliveryAttempt.objects.get(delivery=delivery).error == "Apprise reported a failure"
