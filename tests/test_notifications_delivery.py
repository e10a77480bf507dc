"""Notifications delivered by real RQ workers to a real local HTTP receiver: signed once,
retried with the same webhook-id, nothing lost to a Redis FLUSHALL, and an approval never
waits for a receiver."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.db.models import Q
from django.utils import timezone
from standardwebhooks.webhooks import Webhook

from approvals.models import Approval
from approvals.services.decisions import approval_decide
from audit.services import Actor
from notifications.models import Delivery, DeliveryAttempt, Subscription
from notifications.services.delivery import deliveries_reconcile
from notifications.services.dispatch import notifications_dispatch_all
from notifications.services.subscriptions import subscription_create, subscription_test
from tests.fixtures.engine import wait_for
from tests.notify_receiver import Receiver, running_receiver

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

NOTIFY_KEY = Fernet.generate_key().decode()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running_receiver() as server:
        yield server


@pytest.fixture
def notify_settings(settings: Any) -> dict[str, str]:
    """This process and its workers may post to 127.0.0.1 over http, quick retries."""
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    settings.AIRLOCK_NOTIFY_KEY = NOTIFY_KEY
    return {
        "AIRLOCK_WEBHOOK_ALLOW_HTTP": "true",
        "AIRLOCK_WEBHOOK_ALLOW_HOSTS": "127.0.0.1",
        "AIRLOCK_NOTIFY_KEY": NOTIFY_KEY,
        "AIRLOCK_NOTIFY_BACKOFF_BASE_SECONDS": "0.2",
        "AIRLOCK_NOTIFY_BACKOFF_CAP_SECONDS": "0.4",
        "AIRLOCK_WEBHOOK_TIMEOUT_SECONDS": "2",
    }


def _subscribe(world: Any, url: str, **fields: Any) -> str:
    admin = world.person("adele", "admins")
    created = subscription_create(
        actor=Actor.person(admin),
        name="on-call hook",
        target=fields.pop("target", "operators"),
        event_types=fields.pop("event_types", ["approval.requested"]),
        channel="webhook",
        url=url,
        **fields,
    )
    return created.secret


def _delivery_status() -> list[str]:
    return list(Delivery.objects.values_list("status", flat=True))


def test_a_per_call_approval_notifies_a_subscribed_webhook_once_with_a_valid_signature(
    engine_world: Any, policy: Any, rq_worker: Any, receiver: Receiver, notify_settings: Any
) -> None:
    secret = _subscribe(engine_world, receiver.url)
    assert secret.startswith("whsec_")
    action = engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    approval = Approval.objects.get(action=action)
    worker = rq_worker(line="notify", **notify_settings)
    wait_for(lambda: _delivery_status() == ["delivered"], timeout=30)
    time.sleep(1.0)  # anything more would arrive now
    assert len(receiver.received) == 1, worker.output()
    request = receiver.received[0]
    assert request.path == "/hooks/airlock?token=t0ps3cret"
    payload = Webhook(secret).verify(request.body, request.headers)
    assert payload["type"] == "approval.requested"
    data = payload["data"]
    assert data["approval"] == str(approval.pk)
    assert data["resource"] == "notification-policy/prod-alerts"
    assert data["agent"] == "deploy-bot" and data["run"] == str(engine_world.run.pk)
    assert data["conflict_class"] == "replace_shared_document"
    assert data["deadline"] == approval.expires_at.isoformat()
    assert data["link"].endswith(f"/approvals/#approval-{approval.pk}")
    assert request.headers["webhook-id"] == Delivery.objects.get().webhook_id
    with pytest.raises(Exception, match="signature"):
        Webhook("whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=").verify(
            request.body, request.headers
        )


def test_a_receiver_failing_twice_gets_the_event_once_more_with_the_same_webhook_id(
    engine_world: Any, policy: Any, rq_worker: Any, receiver: Receiver, notify_settings: Any
) -> None:
    receiver.script = [(500, {}), (500, {})]
    secret = _subscribe(engine_world, receiver.url)
    engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    worker = rq_worker(line="notify", **notify_settings)
    wait_for(lambda: _delivery_status() == ["delivered"], timeout=30)
    time.sleep(1.5)
    assert len(receiver.received) == 3, worker.output()
    ids = {request.headers["webhook-id"] for request in receiver.received}
    assert len(ids) == 1
    for request in receiver.received:
        Webhook(secret).verify(request.body, request.headers)
    assert len({request.body for request in receiver.received}) == 1
    delivery = Delivery.objects.get()
    assert delivery.attempts == 3
    codes = list(
        DeliveryAttempt.objects.filter(delivery=delivery)
        .order_by("number")
        .values_list("status_code", flat=True)
    )
    assert codes == [500, 500, 200]


def test_a_redis_flushall_between_attempts_loses_nothing_and_doubles_nothing(
    engine_world: Any,
    policy: Any,
    rq_worker: Any,
    engine_redis: Any,
    receiver: Receiver,
    notify_settings: Any,
) -> None:
    # The first answer asks for a retry in 2 s: that retry is a scheduled RQ job, which
    # FLUSHALL then wipes; PostgreSQL still says the delivery is due.
    receiver.script = [(503, {"Retry-After": "2"})]
    _subscribe(engine_world, receiver.url)
    engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    worker = rq_worker(line="notify", **notify_settings)
    receiver.wait_for(1)
    wait_for(
        lambda: Delivery.objects.get().attempts == 1 and DeliveryAttempt.objects.count() == 1,
        timeout=10,
    )
    first_at = time.monotonic()
    engine_redis.client().flushall()
    delivery = Delivery.objects.get()
    assert delivery.status == "pending"
    wait_for(lambda: time.monotonic() - first_at > 2.5, timeout=5)

    def due() -> bool:  # the retry's time has come (backoff's jitter, a loaded machine)
        now = timezone.now()
        return (
            Delivery.objects.filter(pk=delivery.pk, next_attempt_at__lte=now)
            .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
            .exists()
        )

    wait_for(due, timeout=30)
    assert len(receiver.received) == 1  # the scheduled retry went with Redis
    assert deliveries_reconcile() == 1
    wait_for(lambda: _delivery_status() == ["delivered"], timeout=20)
    time.sleep(1.0)
    assert deliveries_reconcile() == 0
    time.sleep(0.5)
    assert len(receiver.received) == 2, worker.output()
    assert len({request.headers["webhook-id"] for request in receiver.received}) == 1


def test_a_job_lost_before_any_attempt_is_resent_by_the_reconciler(
    engine_world: Any,
    policy: Any,
    rq_worker: Any,
    engine_redis: Any,
    receiver: Receiver,
    notify_settings: Any,
) -> None:
    _subscribe(engine_world, receiver.url)
    engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    notifications_dispatch_all()  # the chain's reader wrote the delivery and enqueued its job
    engine_redis.client().flushall()  # the job enqueued at commit is gone
    worker = rq_worker(line="notify", **notify_settings)
    time.sleep(1.0)
    assert receiver.received == [] and _delivery_status() == ["pending"]
    assert deliveries_reconcile() == 1
    wait_for(lambda: _delivery_status() == ["delivered"], timeout=20)
    assert len(receiver.received) == 1, worker.output()


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield int(sock.getsockname()[1])


def test_a_dead_receiver_never_delays_an_approval_or_its_decision(
    engine_world: Any, policy: Any, rq_worker: Any, black_hole: int, notify_settings: Any
) -> None:
    _subscribe(
        engine_world,
        f"http://127.0.0.1:{black_hole}/hook",
        event_types=["approval.requested", "approval.decided"],
    )
    worker = rq_worker(line="notify", **notify_settings)
    started = time.monotonic()
    action = engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    proposed = time.monotonic() - started
    # the worker is now stuck on the black hole (2 s timeout): the decision does not wait
    wait_for(lambda: Delivery.objects.filter(claimed_until__isnull=False).exists(), timeout=10)
    started = time.monotonic()
    approval_decide(
        approval_id=Approval.objects.get(action=action).pk,
        actor=Actor.person(engine_world.operator),
        decision="reject",
        comment="no",
    )
    decided = time.monotonic() - started
    assert proposed < 1.0 and decided < 1.0, (proposed, decided, worker.output())
    wait_for(lambda: Delivery.objects.count() == 2, timeout=10)  # the worker read the decision
    wait_for(
        lambda: DeliveryAttempt.objects.filter(error__startswith="ReadTimeout").exists(),
        timeout=15,
    )
    assert Subscription.objects.get().disabled_at is None


def test_a_delivery_stuck_on_a_black_hole_never_delays_an_approved_write(
    engine_world: Any, policy: Any, rq_worker: Any, black_hole: int, notify_settings: Any
) -> None:
    """Deliveries have their own queue and worker line: while the notifications worker waits
    on a receiver that never answers (30 s), the engine's worker applies an approved write
    at once. (On one shared queue, the engine worker took the delivery first and the write
    waited for the receiver's timeout.)"""
    _subscribe(
        engine_world,
        f"http://127.0.0.1:{black_hole}/hook",
        event_types=["approval.requested", "approval.decided"],
    )
    held = {**notify_settings, "AIRLOCK_WEBHOOK_TIMEOUT_SECONDS": "30"}
    rq_worker(**held)  # the engine's worker line
    notifier = rq_worker(line="notify", **held)
    action = engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    # The approval.requested delivery is in the black hole: claimed, no attempt recorded.
    wait_for(lambda: Delivery.objects.filter(claimed_until__isnull=False).exists(), timeout=15)
    started = time.monotonic()
    approval_decide(
        approval_id=Approval.objects.get(action=action).pk,
        actor=Actor.person(engine_world.operator),
        decision="approve",
        comment="ship it",
    )
    action.refresh_from_db()
    wait_for(lambda: _status(action) == "applied", timeout=10)
    applied_after = time.monotonic() - started
    assert applied_after < 5.0, (applied_after, notifier.output())
    # ... while the first delivery was still waiting on the receiver.
    first = Delivery.objects.get(notification__type="approval.requested")
    assert first.status == "pending" and not DeliveryAttempt.objects.filter(delivery=first).exists()
    wait_for(lambda: Delivery.objects.count() == 2, timeout=10)  # the decision's, queued behind


def test_a_black_hole_subscription_never_delays_another_subscriptions_deliveries(
    engine_world: Any,
    policy: Any,
    rq_worker: Any,
    black_hole: int,
    receiver: Receiver,
    notify_settings: Any,
) -> None:
    """Three deliveries to a receiver that never answers are queued ahead of a healthy
    receiver's three; one notify worker with two threads. The dead one holds one thread (its
    subscription has one attempt in flight at most), the healthy ones arrive at once on the
    other. (One at a time, they waited 3 x 8 s; two threads without the per-subscription
    limit, both threads sat in the black hole.)"""
    admin = Actor.person(engine_world.person("adele", "admins"))
    wanted = ["approval.requested", "test"]
    dead = subscription_create(
        actor=admin,
        name="dead",
        target="operators",
        event_types=wanted,
        channel="webhook",
        url=f"http://127.0.0.1:{black_hole}/hook",
    ).subscription
    for _ in range(2):
        subscription_test(actor=admin, subscription_id=dead.pk)
    healthy = subscription_create(
        actor=admin,
        name="healthy",
        target="operators",
        event_types=wanted,
        channel="webhook",
        url=receiver.url,
    )
    subscription_test(actor=admin, subscription_id=healthy.subscription.pk)
    subscription_test(actor=admin, subscription_id=healthy.subscription.pk)
    engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )  # approval.requested: one delivery to each, the dead one's queued first
    env = {
        **notify_settings,
        "AIRLOCK_WEBHOOK_TIMEOUT_SECONDS": "8",
        "AIRLOCK_NOTIFY_CONCURRENCY": "2",
    }
    worker = rq_worker(line="notify", **env)
    in_hole = Delivery.objects.filter(subscription=dead, claimed_until__isnull=False)
    wait_for(in_hole.exists, timeout=20)
    started = time.monotonic()
    to_healthy = Delivery.objects.filter(subscription=healthy.subscription)
    wait_for(lambda: set(to_healthy.values_list("status", flat=True)) == {"delivered"}, timeout=8)
    elapsed = time.monotonic() - started
    assert elapsed < 3.0, (elapsed, worker.output())
    assert len(receiver.received) == 3
    assert len({request.headers["webhook-id"] for request in receiver.received}) == 3
    for request in receiver.received:
        Webhook(healthy.secret).verify(request.body, request.headers)
    # Meanwhile one delivery is in the black hole and the other two wait for it, unsent.
    assert in_hole.count() == 1 and not DeliveryAttempt.objects.filter(delivery__subscription=dead)
    attempts = Delivery.objects.filter(subscription=dead).values_list("attempts", flat=True)
    assert sorted(attempts) == [0, 0, 1]
    # Its attempt times out and is logged; the next one goes into the hole after it.
    first = in_hole.get()
    wait_for(lambda: DeliveryAttempt.objects.filter(delivery=first).exists(), timeout=15)
    attempt = DeliveryAttempt.objects.get(delivery=first)
    assert attempt.error == "ReadTimeout from 127.0.0.1" and attempt.status_code is None
    assert 7500 <= attempt.latency_ms < 12000
    first.refresh_from_db()
    assert first.status == "pending" and first.attempts == 1
    wait_for(lambda: in_hole.exclude(pk=first.pk).exists(), timeout=5)


def _status(action: Any) -> str:
    action.refresh_from_db(fields=["status"])
    return str(action.status)


def test_an_endpoint_answering_410_is_disabled_and_the_admins_are_told(
    engine_world: Any, policy: Any, rq_worker: Any, receiver: Receiver, notify_settings: Any
) -> None:
    receiver.default = (410, {})
    _subscribe(engine_world, receiver.url)
    engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    rq_worker(line="notify", **notify_settings)
    wait_for(lambda: Subscription.objects.get().disabled_at is not None, timeout=20)
    assert _delivery_status() == ["disabled"]
    from audit.models import AuditEvent

    event = AuditEvent.objects.get(event_type="notification_subscription.disabled")
    assert event.details["reason"] == "the endpoint answered 410 Gone"
    assert len(receiver.received) == 1
    body = json.loads(receiver.received[0].body)
    assert body["type"] == "approval.requested"


def test_a_worker_killed_mid_delivery_loses_nothing_and_resends_the_same_webhook_id(
    engine_world: Any, policy: Any, rq_worker: Any, receiver: Receiver, notify_settings: Any
) -> None:
    receiver.delay_seconds = 30  # the receiver holds the first request: the worker waits
    _subscribe(engine_world, receiver.url)
    engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    claim = {"AIRLOCK_NOTIFY_CLAIM_SECONDS": "2", "AIRLOCK_WEBHOOK_TIMEOUT_SECONDS": "30"}
    first = rq_worker(line="notify", **{**notify_settings, **claim})
    receiver.wait_for(1)
    os.killpg(first.pid, signal.SIGKILL)  # mid-delivery: sent, outcome never recorded
    first.process.wait(timeout=5)
    receiver.delay_seconds = 0
    delivery = Delivery.objects.get()
    assert delivery.status == "pending" and delivery.attempts == 1
    assert not DeliveryAttempt.objects.exists()
    assert deliveries_reconcile() == 0  # the claim has not lapsed yet: it may still be alive
    wait_for(lambda: timezone.now() > Delivery.objects.get().claimed_until, timeout=5)
    second = rq_worker(line="notify", **notify_settings)
    assert deliveries_reconcile() == 1
    wait_for(lambda: _delivery_status() == ["delivered"], timeout=20)
    assert deliveries_reconcile() == 0
    time.sleep(1.0)
    assert len(receiver.received) == 2, second.output()
    assert len({request.headers["webhook-id"] for request in receiver.received}) == 1
    assert list(DeliveryAttempt.objects.values_list("number", "status_code")) == [(2, 200)]


def test_a_warm_shutdown_records_the_attempt_in_flight_before_the_worker_exits(
    engine_world: Any, policy: Any, rq_worker: Any, receiver: Receiver, notify_settings: Any
) -> None:
    receiver.delay_seconds = 2.0  # the attempt is in flight when SIGTERM arrives
    _subscribe(engine_world, receiver.url)
    engine_world.propose(
        policy, "prod-alerts", payload={"severity": "critical"}, observed_version=1
    )
    # A timeout well past the receiver's delay (with the 2 s of notify_settings the attempt
    # sometimes timed out first and was recorded as a retry, not delivered).
    patient = {**notify_settings, "AIRLOCK_WEBHOOK_TIMEOUT_SECONDS": "10"}
    worker = rq_worker(line="notify", **patient)
    receiver.wait_for(1)
    os.kill(worker.pid, signal.SIGTERM)
    worker.process.wait(timeout=20)
    delivery = Delivery.objects.get()
    assert delivery.status == "delivered", worker.output()[-3000:]
    assert list(DeliveryAttempt.objects.values_list("number", "status_code")) == [(1, 200)]
