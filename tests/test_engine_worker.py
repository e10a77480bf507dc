"""Real RQ worker processes, real Redis (private server), real PostgreSQL commits."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, Approval, Operation
from approvals.services.decisions import approval_decide
from approvals.services.reconcile import reconcile
from audit.models import AuditEvent
from audit.services import Actor
from console.services import kill_switch_set
from ownership.models import Resource, ResourceVersion
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _status(action: Action) -> str:
    return Action.objects.values_list("status", flat=True).get(pk=action.pk)


def _final(*actions: Action) -> bool:
    return all(
        _status(a) in {"applied", "conflict", "failed", "rejected", "expired", "cancelled"}
        for a in actions
    )


def test_an_approved_per_call_action_is_applied_by_a_worker(
    engine_world: Any, engine_redis: Any, rq_worker: Any
) -> None:
    action = engine_world.proposed_critical_alert()
    worker = rq_worker()
    approval = Approval.objects.get(action=action)
    from approvals.notify import action_channel

    pubsub = engine_redis.client().pubsub()
    pubsub.subscribe(action_channel(action.pk))
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    wait_for(lambda: _final(action), timeout=20)
    assert _status(action) == "applied", worker.output()
    # long-pollers were woken for queued, executing and applied
    messages = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and len(messages) < 3:
        message = pubsub.get_message(timeout=0.2)
        if message and message["type"] == "message":
            messages.append(message)
    assert len(messages) >= 3
    pubsub.close()
    assert Resource.objects.get(name="prod-alerts").document == {"severity": "critical"}
    op = Operation.objects.get(action=action)
    assert op.status == "done" and op.fence > 0 and op.undo_deadline is not None


def test_kill_switch_pauses_queued_work_and_release_applies_it_in_order_exactly_once(
    engine_world: Any, rq_worker: Any
) -> None:
    kind = engine_world.kind("dns-record", create="add_unique")
    first = [
        engine_world.propose(
            kind, f"staging-{i}", operation="create", payload={"ip": f"10.0.0.{i}"}
        )
        for i in range(3)
    ]
    kill_switch_set(
        scope="dns-record/staging-*",
        engaged=True,
        reason="incident 42",
        actor=Actor.person(engine_world.operator),
    )
    for action in first:
        action.refresh_from_db()
        assert action.status == "paused" and action.paused_reason == "incident 42"

    worker = rq_worker()
    # Work queued while engaged pauses when its job runs.
    later = [
        engine_world.propose(
            kind, f"staging-{i}", operation="create", payload={"ip": f"10.0.0.{i}"}
        )
        for i in range(3, 5)
    ]
    wait_for(lambda: all(_status(a) == "paused" for a in later), timeout=20)
    assert Action.objects.get(pk=later[0].pk).paused_reason == "incident 42"
    assert not Resource.objects.filter(kind=kind).exists()

    kill_switch_set(
        scope="dns-record/staging-*",
        engaged=False,
        reason="",
        actor=Actor.person(engine_world.operator),
    )
    everything = first + later
    wait_for(lambda: _final(*everything), timeout=30)
    assert [_status(a) for a in everything] == ["applied"] * 5, worker.output()
    applied_order = list(
        AuditEvent.objects.filter(event_type="write.applied", resource__startswith="dns-record/")
        .order_by("seq")
        .values_list("action_id", flat=True)
    )
    assert applied_order == [a.pk for a in everything]
    assert ResourceVersion.objects.filter(resource__kind=kind).count() == 5


def test_flushall_with_twenty_approved_actions_loses_nothing_and_doubles_nothing(
    engine_world: Any, engine_redis: Any, rq_worker: Any
) -> None:
    kind = engine_world.kind("group", create="access_change")  # per-call approval
    actions = [
        engine_world.propose(kind, f"team-{i:02d}", operation="create", payload={"n": i})
        for i in range(20)
    ]
    for action in actions:
        approval = Approval.objects.get(action=action)
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
        )
    assert {_status(a) for a in actions} == {"queued"}
    assert engine_redis.client().llen("rq:queue:default") == 20
    engine_redis.client().flushall()
    assert engine_redis.client().llen("rq:queue:default") == 0

    worker = rq_worker()
    counts = reconcile(now=timezone.now() + timedelta(seconds=5))
    assert counts["requeued"] == 20
    # A second pass while those jobs are pending sends nothing more.
    assert reconcile(now=timezone.now() + timedelta(seconds=5))["requeued"] == 0
    wait_for(lambda: _final(*actions), timeout=60)
    assert {_status(a) for a in actions} == {"applied"}, worker.output()
    assert ResourceVersion.objects.filter(resource__kind=kind).count() == 20
    assert AuditEvent.objects.filter(event_type="write.applied").count() == 20
    assert Operation.objects.filter(status="done").count() == 20
    # Re-delivering every job again changes nothing.
    from approvals.outbox import enqueue_action_execution

    for action in actions:
        enqueue_action_execution(action.pk)
    wait_for(lambda: engine_redis.client().llen("rq:queue:default") == 0, timeout=30)
    assert reconcile(now=timezone.now() + timedelta(seconds=5))["requeued"] == 0
    assert ResourceVersion.objects.filter(resource__kind=kind).count() == 20
    assert AuditEvent.objects.filter(event_type="write.applied").count() == 20


@pytest.mark.parametrize(
    "crash_at", ["after_open_operation", "inside_barrier_before_commit", "after_barrier_commit"]
)
def test_a_worker_killed_mid_job_leaves_the_action_applied_exactly_once(
    engine_world: Any, rq_worker: Any, crash_at: str
) -> None:
    kind = engine_world.kind("dns-record", create="add_unique")
    doomed = rq_worker(AIRLOCK_TEST_CRASH_AT=crash_at)
    action = engine_world.propose(kind, "victim", operation="create", payload={"ip": "10.1.1.1"})
    wait_for(lambda: not doomed.alive(), timeout=20)
    assert doomed.process.returncode == -9, doomed.output()

    # After the lease has expired the reconciler takes the operation back.
    counts = reconcile(now=timezone.now() + timedelta(seconds=30))
    if crash_at == "after_barrier_commit":
        assert _status(action) == "applied" and counts["abandoned"] == 0
    else:
        assert counts["abandoned"] == 1
        assert Operation.objects.filter(action=action, status="failed").count() == 1
    survivor = rq_worker()
    wait_for(lambda: _final(action), timeout=30)
    assert _status(action) == "applied", survivor.output()
    assert ResourceVersion.objects.filter(resource__kind=kind).count() == 1
    assert AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).count() == 1
    assert Operation.objects.filter(action=action, status="done").count() == 1
    assert reconcile(now=timezone.now() + timedelta(seconds=30)) == {
        "abandoned": 0,
        "requeued": 0,
        "undo_requeued": 0,
        "resumed": 0,
        "plans_advanced": 0,
    }
