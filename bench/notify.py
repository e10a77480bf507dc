"""The figure "approval round trip with a black-hole webhook subscriber ÷ without" (issue 40:
a dead receiver does not slow approvals).

A listening socket in this process that never accepts and never answers is the black hole;
an admin's webhook subscription to every event, for everyone, points at it. The Procfile's
`notify` line is restarted with the two settings that let it connect to 127.0.0.1 over
http (AIRLOCK_WEBHOOK_ALLOW_HTTP, AIRLOCK_WEBHOOK_ALLOW_HOSTS; otherwise it would refuse
the address at once instead of waiting on it), so its attempts really sit in the hole for
their timeout while the bench decides approvals. Rounds alternate (order flipped every other
round) between the subscription paused — the notify worker's reader of the audit chain
finds nobody to tell — and active, when it writes every decision's notification and delivery
(after the decision committed: docs/notifications.md "Outbox") and its pool's attempts sit in
the hole. Each round is bench.loadgen's round
trip (decision sent → the waiting agent's long-poll answered); the figure is the median of
the per-round ratios p50 without ÷ p50 with (≥ 0.9: within 10 %). One short active run
before the rounds is not counted (warm-up).
"""

from __future__ import annotations

import socket
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.conf import settings
from rq import Queue, Worker

from approvals.outbox import engine_redis
from audit.services import Actor
from bench import fixtures
from bench.report import figure
from bench.stack import log
from notifications.models import Delivery, DeliveryAttempt, Subscription
from notifications.outbox import QUEUE_NAME
from notifications.services.dispatch import dispatch_lag
from notifications.services.subscriptions import (
    subscription_create,
    subscription_delete,
    subscription_update,
)

if TYPE_CHECKING:  # bench.run registers this figure (bench.figures imports models)
    from bench.figures import Bench

KEYS = ["notify_black_hole_round_trip_ratio"]
# Per size: rounds (each one paused and one active run), and decisions timed per run.
_ROUNDS = {"tiny": 1, "small": 2, "default": 5}
_SAMPLES = {"tiny": 5, "small": 12, "default": 40}
_WAITING = 20  # agents still waiting while each decision is timed
_LOOPBACK = {"AIRLOCK_WEBHOOK_ALLOW_HTTP": "true", "AIRLOCK_WEBHOOK_ALLOW_HOSTS": "127.0.0.1"}


@contextmanager
def _black_hole() -> Iterator[int]:
    """A port that completes TCP handshakes (the kernel's backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        yield int(sock.getsockname()[1])


def _notify_line(b: Bench, **env: str) -> None:
    """(Re)start the Procfile's notify line with `env` added; wait until it listens."""
    b.stack.stop("notify")
    b.stack.start_procfile("notify", extra_env=env)
    queue = Queue(QUEUE_NAME, connection=engine_redis())
    deadline = time.monotonic() + 60
    while not Worker.all(queue=queue) and time.monotonic() < deadline:
        time.sleep(0.2)


def _caught_up(timeout: float = 30.0) -> None:
    """Wait until the notify worker has read the audit chain to its head: a subscription is
    matched when an event is read, so pausing it first would drop the last run's events."""
    deadline = time.monotonic() + timeout
    while dispatch_lag() and time.monotonic() < deadline:
        time.sleep(0.05)


def _round(b: Bench, samples: int, subscription: Subscription, *, active: bool) -> dict[str, Any]:
    """One timed run. Its approvals are opened while the subscription is paused (the agents'
    proposals are not what is timed, and their notifications would only add a burst of jobs
    to the notify worker's start of the run), then the subscription is set."""
    admin = Actor.person(b.world.admin)
    _caught_up()
    subscription_update(actor=admin, subscription_id=subscription.pk, paused=True)
    names = [f"nb-{uuid.uuid4().hex[:6]}-{i}" for i in range(_WAITING + samples)]
    items = b.decision_items(fixtures.pending(b.main, "bench-wait", names))
    subscription_update(actor=admin, subscription_id=subscription.pk, paused=not active)
    spec = {"mode": "roundtrip", "port": b.stack.web_port, "token": b.main.token}
    spec.update(items=items, samples=samples, back_to_back=0, wait=60, settle=1.0)
    return b.loadgen(spec)


def _ratio(without: dict[str, Any], active: dict[str, Any]) -> float | None:
    if not without.get("p50_ms") or not active.get("p50_ms"):
        return None
    return round(float(without["p50_ms"]) / float(active["p50_ms"]), 3)


def black_hole_round_trip(b: Bench) -> dict[str, Any]:
    rounds, samples = _ROUNDS[b.size.name], _SAMPLES[b.size.name]
    admin = Actor.person(b.world.admin)
    runs: list[dict[str, dict[str, Any]]] = []
    # The orchestrator saves the subscription: its address check must allow the hole too.
    saved = settings.AIRLOCK_WEBHOOK_ALLOW_HTTP, settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP, settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = True, ["127.0.0.1"]
    with _black_hole() as port:
        subscription = subscription_create(
            actor=admin,
            name="bench black hole",
            target="*",
            channel="webhook",
            url=f"http://127.0.0.1:{port}/hook",
            paused=True,
        ).subscription
        try:
            _notify_line(b, **_LOOPBACK)
            # Not counted: each web process's first notified events pay for connections and
            # imports the rounds then reuse (the first round was the slowest in every run).
            _round(b, 5, subscription, active=True)
            for number in range(rounds):
                pair: dict[str, dict[str, Any]] = {}
                for active in (False, True) if number % 2 == 0 else (True, False):
                    run = _round(b, samples, subscription, active=active)
                    pair["with" if active else "without"] = run
                runs.append(pair)
                log(
                    f"notify black hole: round trip p50 {pair['without']['p50_ms']} ms without, "
                    f"{pair['with']['p50_ms']} ms with (the decision request's p50 "
                    f"{pair['without']['decision_request_p50_ms']} / "
                    f"{pair['with']['decision_request_p50_ms']} ms)"
                )
            _caught_up()
            subscription_update(actor=admin, subscription_id=subscription.pk, paused=True)
            hole = _what_the_hole_got(subscription)
        finally:
            subscription_delete(actor=admin, subscription_id=subscription.pk)
            settings.AIRLOCK_WEBHOOK_ALLOW_HTTP, settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = saved
            _notify_line(b)
    ratios = [r for r in (_ratio(p["without"], p["with"]) for p in runs) if r is not None]
    missed = sum(p["without"]["missed"] + p["with"]["missed"] for p in runs)
    # Honest only if the active rounds' decisions were notified and the hole was tried.
    unheard = int(hole["decided_deliveries"] < samples * rounds + 5) + int(not hole["attempted"])
    log(f"notify black hole: ratios {ratios}; the hole got {hole}")
    return {
        "notify_black_hole_round_trip_ratio": figure(
            "notify_black_hole_round_trip_ratio",
            statistics.median(ratios) if ratios else None,
            errors=missed + unheard,
            ratios=ratios,
            p50_ms={
                "without": [p["without"]["p50_ms"] for p in runs],
                "with": [p["with"]["p50_ms"] for p in runs],
            },
            p99_ms={
                "without": [p["without"]["p99_ms"] for p in runs],
                "with": [p["with"]["p99_ms"] for p in runs],
            },
            decision_request_p50_ms={
                "without": [p["without"]["decision_request_p50_ms"] for p in runs],
                "with": [p["with"]["decision_request_p50_ms"] for p in runs],
            },
            black_hole=hole,
            note=f"median of {len(ratios)} rounds: {ratios}; {samples} decisions a run",
        )
    }


def _what_the_hole_got(subscription: Subscription) -> dict[str, Any]:
    deliveries = Delivery.objects.filter(subscription=subscription)
    attempts = DeliveryAttempt.objects.filter(delivery__subscription=subscription)
    in_flight = deliveries.filter(claimed_until__isnull=False).count()
    return {
        "decided_deliveries": deliveries.filter(notification__type="approval.decided").count(),
        "deliveries": deliveries.count(),
        "attempts_recorded": attempts.count(),
        "attempt_errors": sorted(set(attempts.values_list("error", flat=True)))[:3],
        "in_flight_at_end": in_flight,
        "attempted": bool(in_flight or attempts.exists()),
    }
