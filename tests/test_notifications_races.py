"""Two workers told 410 Gone at the same moment, for two deliveries of one subscription:
both record their attempt, the subscription is disabled once, and neither deadlocks."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection

from audit.models import AuditEvent
from audit.services import Actor
from notifications.models import Delivery, DeliveryAttempt, Subscription
from notifications.services.delivery import delivery_attempt
from notifications.services.subscriptions import subscription_create, subscription_test
from tests.notify_receiver import Receiver, running_receiver

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running_receiver() as server:
        yield server


def test_two_workers_told_gone_at_once_both_finish_and_disable_it_once(
    receiver: Receiver, settings: Any
) -> None:
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    user = User.objects.create_user(username="adele", password=None)
    user.groups.add(Group.objects.get_or_create(name="admins")[0])
    admin = Actor.person(user)
    created = subscription_create(actor=admin, name="h", channel="webhook", url=receiver.url)
    deliveries = [
        subscription_test(actor=admin, subscription_id=created.subscription.pk) for _ in range(2)
    ]
    receiver.default = (410, {})
    receiver.delay_seconds = 0.5  # both requests are held, then answered together
    outcomes: dict[int, str] = {}
    errors: list[BaseException] = []

    def attempt(index: int) -> None:
        try:
            outcomes[index] = delivery_attempt(delivery_id=deliveries[index].pk)
        except BaseException as exc:  # a deadlock would surface here
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert len(receiver.received) == 2
    assert sorted(outcomes.values()) == ["disabled", "disabled"]
    assert Subscription.objects.get().disabled_at is not None
    assert set(Delivery.objects.values_list("status", flat=True)) == {"disabled"}
    assert DeliveryAttempt.objects.count() == 2
    assert AuditEvent.objects.filter(event_type="notification_subscription.disabled").count() == 1
