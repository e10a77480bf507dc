"""An undo, once accepted, is never lost (issue 9, item 2).

Real RQ worker processes on a private Redis, with a short retry budget
(AIRLOCK_MAX_ATTEMPTS=2, backoff 0.05-0.2 s): the waits below are several times
that budget, so an undo that burned attempts would already have ended `failed`.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from approvals.models import Action, Operation
from approvals.outbox import engine_redis
from approvals.services.execution import action_execute
from approvals.services.reconcile import reconcile
from approvals.services.undo import _retry_undo, action_undo_request, undo_execute
from audit.models import AuditEvent
from audit.services import Actor
from console.services import kill_switch_set
from engine.core.lock import FencedLock
from ownership.models import ResourceVersion
from tests.fixtures.engine import wait_for

SHORT_BUDGET = {
    "AIRLOCK_MAX_ATTEMPTS": "2",
    "AIRLOCK_BACKOFF_BASE_SECONDS": "0.05",
    "AIRLOCK_BACKOFF_CAP_SECONDS": "0.2",
}
# Well past the short budget, including RQ's scheduler moving delayed retries (~1 s each).
PAST_THE_BUDGET_SECONDS = 5.0
SYSTEM = Actor.system("test")
# Workers and concurrent requests see only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


def _applied(engine_world: Any, name: str = "a") -> tuple[Any, Any]:
    kind = engine_world.kind("cfg", update="recompute_field", owner_group="operators")
    engine_world.resource(kind, name, {"n": 0})
    action = engine_world.propose(kind, name, payload={"n": 1}, observed_version=1)
    assert action_execute(action_id=action.pk) == "applied"
    return kind, action


def _status(action: Any) -> str:
    return str(Action.objects.values_list("status", flat=True).get(pk=action.pk))


def _undone_exactly_once(action: Any) -> None:
    assert _status(action) == "undone"
    assert ResourceVersion.objects.filter(action_id=action.pk, operation="undo").count() == 1
    assert AuditEvent.objects.filter(event_type="write.undone", action_id=action.pk).count() == 1
    undos = Operation.objects.filter(action=action, undo_of__isnull=False, status="done")
    assert undos.count() == 1
    latest = ResourceVersion.objects.filter(resource_id=action.resource_id).order_by("-version")
    assert latest[0].document == {"n": 0}


@pytest.mark.slow
def test_an_undo_held_by_a_kill_switch_past_its_retry_budget_applies_once_on_release(
    engine_world: Any, rq_worker: Any
) -> None:
    _, action = _applied(engine_world)
    kill_switch_set(scope="cfg/a*", engaged=True, reason="incident 42", actor=SYSTEM)
    undo_op = action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator))
    worker = rq_worker(**SHORT_BUDGET)
    wait_for(lambda: Operation.objects.get(pk=undo_op.pk).paused_reason == "incident 42")
    time.sleep(PAST_THE_BUDGET_SECONDS)
    undo_op.refresh_from_db()
    assert undo_op.status == "pending", worker.output()
    assert (undo_op.outcome or {}).get("attempts", 0) == 0
    assert _status(action) == "applied"

    kill_switch_set(scope="cfg/a*", engaged=False, reason="", actor=SYSTEM)
    wait_for(lambda: _status(action) == "undone", timeout=30)
    _undone_exactly_once(action)
    released = AuditEvent.objects.get(event_type="kill_switch.released")
    assert released.details["resumed_undos"] == [undo_op.pk]


@pytest.mark.slow
def test_an_undo_waits_out_a_writer_holding_the_lock_longer_than_the_retry_budget(
    engine_world: Any, rq_worker: Any
) -> None:
    _, action = _applied(engine_world)
    holder = FencedLock(engine_redis(), key="cfg/a", ttl_ms=60_000)
    holder.acquire()
    undo_op = action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator))
    worker = rq_worker(**SHORT_BUDGET)
    wait_for(lambda: (Operation.objects.get(pk=undo_op.pk).outcome or {}).get("lock_waits", 0) >= 2)
    time.sleep(PAST_THE_BUDGET_SECONDS)
    undo_op.refresh_from_db()
    assert undo_op.status == "pending", worker.output()
    assert _status(action) == "applied"

    holder.release()
    wait_for(lambda: _status(action) == "undone", timeout=30)
    _undone_exactly_once(action)


@pytest.mark.slow
def test_an_undo_accepted_before_the_deadline_and_executed_after_it_applies(
    engine_world: Any, rq_worker: Any
) -> None:
    _, action = _applied(engine_world)
    original = Operation.objects.get(action=action, undo_of__isnull=True)
    deadline = timezone.now() + timedelta(seconds=1)
    Operation.objects.filter(pk=original.pk).update(undo_deadline=deadline)
    undo_op = action_undo_request(
        action_id=action.pk, actor=Actor.person(engine_world.operator)
    )  # 202
    while timezone.now() <= deadline:
        time.sleep(0.05)
    worker = rq_worker(**SHORT_BUDGET)  # the worker gets to it only after the deadline
    wait_for(lambda: Operation.objects.get(pk=undo_op.pk).status != "pending", timeout=30)
    assert Operation.objects.get(pk=undo_op.pk).status == "done", worker.output()
    _undone_exactly_once(action)


@pytest.mark.slow
def test_after_a_flushall_the_reconciler_resends_a_pending_and_a_resumed_paused_undo_once(
    engine_world: Any, engine_redis: Any, rq_worker: Any
) -> None:
    kind, action = _applied(engine_world)
    engine_world.resource(kind, "b", {"n": 0})
    other = engine_world.propose(kind, "b", payload={"n": 1}, observed_version=1)
    assert action_execute(action_id=other.pk) == "applied"

    # A paused undo on cfg/a (a worker paused it), and a pending one on cfg/b.
    kill_switch_set(scope="cfg/a", engaged=True, reason="freeze", actor=SYSTEM)
    paused = action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator))
    assert undo_execute(undo_operation_id=paused.pk) == "paused"
    pending = action_undo_request(action_id=other.pk, actor=Actor.person(engine_world.operator))
    # The switch row is released behind the service's back (restored backup, manual
    # fix): nothing enqueues the paused undo. Then Redis loses everything.
    from console.models import KillSwitch

    KillSwitch.objects.filter(scope="cfg/a").update(engaged=False)
    engine_redis.client().flushall()
    Operation.objects.filter(pk__in=[paused.pk, pending.pk]).update(
        started_at=timezone.now() - timedelta(seconds=10)
    )
    worker = rq_worker(**SHORT_BUDGET)
    counts = reconcile()
    assert counts["undo_requeued"] == 2 and counts["resumed"] == 1, counts
    wait_for(lambda: _status(action) == "undone" and _status(other) == "undone", timeout=30)
    _undone_exactly_once(action)
    assert AuditEvent.objects.filter(event_type="write.undone", action_id=other.pk).count() == 1
    # Resending again changes nothing.
    assert reconcile()["undo_requeued"] == 0, worker.output()
    assert AuditEvent.objects.filter(event_type="write.undone").count() == 2


def test_an_undo_that_failed_for_a_retryable_reason_can_be_asked_for_again(
    engine_world: Any, engine_redis: Any, settings: Any
) -> None:
    _, action = _applied(engine_world)
    first = action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator))
    settings.AIRLOCK_MAX_ATTEMPTS = 1
    assert _retry_undo(first, "ConnectionError", None) == "failed"
    first.refresh_from_db()
    assert first.status == "failed" and first.outcome["retryable"] is True

    # The resource page offers the undo again.
    client = Client()
    client.force_login(engine_world.operator)
    original = Operation.objects.get(action=action, undo_of__isnull=True)
    html = client.get("/resources/cfg/a/").content.decode()
    assert f'action="/operations/{original.pk}/undo/"' in html

    again = action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator))
    assert again.pk != first.pk and again.status == "pending"
    # However many requests, one live undo.
    assert (
        action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator)).pk
        == again.pk
    )
    assert undo_execute(undo_operation_id=again.pk) == "undone"
    _undone_exactly_once(action)


def test_the_database_keeps_one_live_undo_per_operation(
    engine_world: Any, engine_redis: Any
) -> None:
    from django.db import IntegrityError, transaction

    _, action = _applied(engine_world)
    first = action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator))
    with pytest.raises(IntegrityError), transaction.atomic():
        Operation.objects.create(action=action, undo_of_id=first.undo_of_id, fence=first.fence + 1)
    assert connection.vendor == "postgresql"
