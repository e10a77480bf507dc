"""Two workers at two deliveries of one subscription at the same moment: only one attempt
is in flight (the other is "busy", sent after it); and two told 410 Gone at once (a claim
that lapsed lets a second attempt start) both record their attempt, the subscription is
disabled once, and neither deadlocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.contrib.auth.models import Group, User
from django.db import connection
from django.utils import timezone

from audit.models import AuditEvent
from audit.services import Actor
from notifications.models import Delivery, DeliveryAttempt, Subscription
from notifications.outbox import deliveries_with_jobs
from notifications.services.delivery import deliveries_reconcile, delivery_attempt
from notifications.services.subscriptions import subscription_create, subscription_test
from tests.notify_receiver import Receiver, running_receiver

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running_receiver() as server:
        yield server


@pytest.fixture
def admin(db: Any) -> Actor:
    user = User.objects.create_user(username="adele", password=None)
    user.groups.add(Group.objects.get_or_create(name="admins")[0])
    return Actor.person(user)


def _two_deliveries(admin: Actor, receiver: Receiver, settings: Any) -> list[Delivery]:
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    created = subscription_create(actor=admin, name="h", channel="webhook", url=receiver.url)
    return [
        subscription_test(actor=admin, subscription_id=created.subscription.pk) for _ in range(2)
    ]


def _in_threads(*calls: Callable[[], str], stagger: float = 0.0) -> list[str]:
    """Run each call in a thread of its own (its own connection), `stagger` s apart."""
    outcomes: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            outcomes[index] = calls[index]()
        except BaseException as exc:  # a deadlock would surface here
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
        time.sleep(stagger)
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    return [outcomes[i] for i in range(len(calls))]


def _lose_the_jobs(engine_redis: Any) -> None:
    """What a Redis FLUSHALL does (a private server: nobody else's data)."""
    redis.Redis.from_url(engine_redis.url).flushall()


def test_two_deliveries_of_one_subscription_are_never_attempted_side_by_side(
    admin: Actor, receiver: Receiver, settings: Any, engine_redis: Any
) -> None:
    deliveries = _two_deliveries(admin, receiver, settings)
    _lose_the_jobs(engine_redis)
    receiver.delay_seconds = 1.0  # the first attempt is in flight when the second starts
    gate = threading.Barrier(2)

    def attempt(delivery: Delivery) -> Callable[[], str]:
        def run() -> str:
            gate.wait()  # both claim at the same moment
            return delivery_attempt(delivery_id=delivery.pk)

        return run

    outcomes = _in_threads(*(attempt(delivery) for delivery in deliveries))
    assert sorted(outcomes) == ["busy", "delivered"]
    assert len(receiver.received) == 1
    waiting = Delivery.objects.get(pk=deliveries[outcomes.index("busy")].pk)
    # Left as it was: due, unclaimed, no attempt counted; sent next, and then delivered.
    assert waiting.status == "pending" and waiting.attempts == 0
    assert waiting.claimed_until is None
    # ... and its job was sent again when the attempt in flight was recorded.
    assert deliveries_with_jobs([waiting.pk]) == {waiting.pk}
    receiver.delay_seconds = 0
    assert delivery_attempt(delivery_id=waiting.pk) == "delivered"
    assert DeliveryAttempt.objects.count() == 2


def test_two_workers_told_gone_at_once_both_finish_and_disable_it_once(
    admin: Actor, receiver: Receiver, settings: Any
) -> None:
    # The first attempt outlives its claim (1 s): the second delivery is then not busy, and
    # both requests are answered 410 at the same moment.
    settings.AIRLOCK_NOTIFY_CLAIM_SECONDS = 1
    deliveries = _two_deliveries(admin, receiver, settings)
    receiver.default = (410, {})
    receiver.together = 2
    outcomes = _in_threads(
        *(lambda d=d: delivery_attempt(delivery_id=d.pk) for d in deliveries), stagger=1.3
    )
    assert len(receiver.received) == 2
    assert sorted(outcomes) == ["disabled", "disabled"]
    assert Subscription.objects.get().disabled_at is not None
    assert set(Delivery.objects.values_list("status", flat=True)) == {"disabled"}
    assert DeliveryAttempt.objects.count() == 2
    assert AuditEvent.objects.filter(event_type="notification_subscription.disabled").count() == 1


def test_the_reconciler_leaves_a_busy_subscriptions_deliveries_to_the_attempt_in_flight(
    admin: Actor, receiver: Receiver, settings: Any, engine_redis: Any
) -> None:
    in_flight, waiting = _two_deliveries(admin, receiver, settings)
    _lose_the_jobs(engine_redis)
    claimed = Delivery.objects.filter(pk=in_flight.pk)
    claimed.update(claimed_until=timezone.now() + timedelta(seconds=30), attempts=1)
    # Resent now, it would only be found busy: it is sent when the attempt ends.
    assert deliveries_reconcile() == 0
    claimed.update(claimed_until=timezone.now() - timedelta(seconds=1))  # its worker died
    assert deliveries_reconcile() == 2
    assert deliveries_with_jobs([in_flight.pk, waiting.pk]) == {in_flight.pk, waiting.pk}
