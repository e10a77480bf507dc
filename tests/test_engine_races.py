"""Forced collisions around a write in flight (review findings 2, 7 and 8), on real
PostgreSQL: a revoke, a run's expiry or a kill-switch engage against the write barrier, and a
stale HTTP worker against the reconciler. tests/test_engine_races_decisions.py holds the
collisions between decisions (findings 3, 4, 14 and T4).

Each test forces the interleaving: one thread holds a transaction open at a
chosen point (threading.Event), the other is started and the test waits until
PostgreSQL reports it blocked on a lock (pg_stat_activity), then releases the
first. No sleeps as synchronisation. Each asserts the invariant: nothing
written after a revoke or an engage committed, one effect recorded once.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, Approval, Operation, Run
from approvals.services.attempts import WORKER_ACTOR, operation_lease_seconds
from approvals.services.decisions import approval_decide
from approvals.services.execution import action_execute
from approvals.services.reconcile import reconcile
from audit.models import AuditEvent
from audit.services import Actor
from console.models import KillSwitch
from console.services import kill_switch_set
from engine.core.barrier import RUN_NOT_ACTIVE, apply_action
from engine.core.errors import KillSwitchEngaged
from engine.core.fence import next_fence
from engine.core.lock import lock_key
from engine.core.operations import open_operation
from ownership.models import Resource
from tests.races import WAIT, Holder, Worker, wait_for_lock_waiters
from tests.targetserver import TargetServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


# -- helpers -------------------------------------------------------------------------


@pytest.fixture
def world(engine_world: Any, engine_redis: Any) -> Any:
    return engine_world


@pytest.fixture
def cfg(world: Any) -> Any:
    kind = world.kind("cfg", update="recompute_field", owner_group="owners")
    world.resource(kind, "a", {"v": 1})
    return kind


def _claimed(world: Any, kind: Any) -> tuple[Action, Operation, int]:
    """A queued per-run write claimed by a worker (action `executing`, operation pending)."""
    action = world.propose(kind, "a", payload={"v": 2}, observed_version=1)
    fence = next_fence()
    operation = open_operation(action_id=action.pk, fence=fence, worker="w", lease_seconds=30)
    return action, operation, fence


# -- finding 2: revoke vs execution ---------------------------------------------------


def test_a_revoke_committing_while_the_barrier_runs_means_nothing_is_applied(
    world: Any, cfg: Any
) -> None:
    action, operation, fence = _claimed(world, cfg)
    from approvals.services.runs import run_revoke

    revoke = Holder(
        lambda: run_revoke(
            run=Run.objects.get(pk=world.run.pk), actor=Actor.person(world.operator), reason="leak"
        )
    ).hold()  # the revoke has run; its transaction (run row, audit head) is open
    execute = Worker(
        lambda: apply_action(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
        )
    )
    execute.start()
    wait_for_lock_waiters(1, threads=(execute,))  # the barrier waits for the revoke
    revoke.release()  # the revoke commits first
    outcome = execute.finish()

    assert outcome.applied is False and outcome.reason == RUN_NOT_ACTIVE
    action.refresh_from_db()
    assert action.status == "cancelled" and action.error["code"] == "run_not_active"
    resource = Resource.objects.get(kind=cfg, name="a")
    assert resource.document == {"v": 1} and resource.version == 1
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).exists()
    assert Operation.objects.get(pk=operation.pk).status == "failed"


def test_a_run_past_expires_at_writes_nothing_before_housekeeping_marks_it(
    world: Any, cfg: Any
) -> None:
    action, operation, fence = _claimed(world, cfg)
    Run.objects.filter(pk=world.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    outcome = apply_action(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
    )
    assert outcome.reason == RUN_NOT_ACTIVE
    action.refresh_from_db()
    assert action.status == "expired"
    assert Resource.objects.get(kind=cfg, name="a").version == 1


def test_a_queued_action_of_an_expired_run_ends_expired_through_the_job(
    world: Any, cfg: Any
) -> None:
    action = world.propose(cfg, "a", payload={"v": 2}, observed_version=1)
    Run.objects.filter(pk=world.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert action_execute(action_id=action.pk) == "run_not_active"
    action.refresh_from_db()
    assert action.status == "expired"


def _active_run(world: Any, resource: str) -> Run:
    from approvals.services import runs

    run, _ = runs.run_create(
        agent=world.agent,
        task="writes " + resource,
        write_set=[{"resource": resource, "operations": ["update"]}],
        ttl_seconds=None,
        actor=Actor.agent(world.agent),
    )
    approval_decide(
        approval_id=Approval.objects.get(run=run, subject="run").pk,
        actor=Actor.person(world.operator),
        decision="approve",
    )
    run.refresh_from_db()
    assert run.status == "active"
    return run


def test_a_write_proposed_in_the_gap_after_a_revoke_is_never_applied(world: Any, cfg: Any) -> None:
    """The order the race produces (review repro): the API's run check passes, the
    operator's revoke commits, then the action is recorded and executed."""
    from approvals.services import actions, preconditions, runs

    run = _active_run(world, "cfg/a")
    kind = actions.action_check_writable(run=run, kind="cfg", name="a", operation="update")
    runs.run_revoke(run=run, actor=Actor.person(world.operator), reason="token leaked")
    proposal = actions.Proposal(
        kind=kind,
        name="a",
        operation="update",
        payload_format="replace",
        payload={"v": 9},
        if_match=preconditions.parse_tag_condition('"1"', header="If-Match"),
        create_if_absent=False,
        idempotency_key="gap-1",
        reason="",
    )
    try:
        action = actions.action_propose(run=run, proposal=proposal)
    except runs.RunNotActive:
        pass  # once action_propose re-checks the run under its lock (API area)
    else:
        assert action_execute(action_id=action.pk) in ("run_not_active", "skipped:cancelled")
        action.refresh_from_db()
        assert action.status == "cancelled"
    resource = Resource.objects.get(kind=cfg, name="a")
    assert resource.version == 1 and resource.document == {"v": 1}
    assert not AuditEvent.objects.filter(event_type="write.applied", run_id=run.pk).exists()


# -- finding 7: kill switch vs a barrier in flight --------------------------------------


def test_a_barrier_that_starts_during_an_engage_writes_nothing(world: Any, cfg: Any) -> None:
    action, operation, fence = _claimed(world, cfg)
    engage = Holder(
        lambda: kill_switch_set(
            scope="*", engaged=True, reason="incident", actor=Actor.person(world.operator)
        )
    ).hold()  # the engage is in its transaction (switch row and audit head held)
    execute = Worker(
        lambda: apply_action(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
        )
    )
    execute.start()
    wait_for_lock_waiters(1, threads=(execute,))  # the barrier is inside, waiting
    engage.release()  # the engage returns to the operator
    with pytest.raises(KillSwitchEngaged):
        execute.finish()
    resource = Resource.objects.get(kind=cfg, name="a")
    assert resource.version == 1 and resource.document == {"v": 1}
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).exists()
    assert Operation.objects.get(pk=operation.pk).status == "pending"


def test_an_engage_waits_for_a_barrier_already_past_its_check(world: Any, cfg: Any) -> None:
    action, operation, fence = _claimed(world, cfg)
    barrier = Holder(
        lambda: apply_action(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
        )
    ).hold()  # written, not yet committed
    engaged = threading.Event()

    def engage() -> Any:
        switch = kill_switch_set(
            scope="*", engaged=True, reason="incident", actor=Actor.person(world.operator)
        )
        engaged.set()
        return switch

    engager = Worker(engage)
    engager.start()
    wait_for_lock_waiters(1, threads=(engager,))
    assert not engaged.is_set()  # the operator is not told "engaged" while a write is open
    assert barrier.release().applied is True
    assert engager.finish().engaged is True
    write = AuditEvent.objects.get(event_type="write.applied", action_id=action.pk)
    switch = AuditEvent.objects.get(event_type="kill_switch.engaged")
    assert write.seq < switch.seq
    assert KillSwitch.objects.get(scope="*").engaged


# -- finding 8: a stale HTTP worker records nothing twice -------------------------------


def _queued_http_write(world: Any, target: TargetServer, settings: Any) -> Action:
    """A queued update of ext-policy/prod, an HTTP target at version 4 (5 s timeout)."""
    settings.AIRLOCK_TARGET_TIMEOUT_SECONDS = 5
    kind = world.kind("ext-policy", update="recompute_field", target_url=target.url)
    target.seed("prod", {"severity": "high"}, version=4)
    action: Action = world.propose(kind, "prod", payload={"severity": "low"}, observed_version=4)
    return action


def _first_write_pauses_after_it_lands(
    monkeypatch: Any,
) -> tuple[threading.Event, threading.Event, list[int]]:
    """The HTTP adapter's first write reaches the target, which applies it; then its worker
    (A) is paused (GC, SIGSTOP) until `resume` is set. (sent, resume, the fence of each write)"""
    from engine.targets.http_etag import HttpEtagTarget

    real_write = HttpEtagTarget.write
    sent, resume = threading.Event(), threading.Event()
    calls: list[int] = []

    def write(self: Any, *args: Any, **kwargs: Any) -> Any:
        response = real_write(self, *args, **kwargs)
        calls.append(kwargs["fence"])
        if len(calls) == 1:
            sent.set()
            assert resume.wait(WAIT)
        return response

    monkeypatch.setattr(HttpEtagTarget, "write", write)
    return sent, resume, calls


def test_a_stale_http_worker_resuming_after_a_replay_records_nothing_twice(
    world: Any, engine_redis: Any, target: TargetServer, settings: Any, monkeypatch: Any
) -> None:
    action = _queued_http_write(world, target, settings)
    sent, resume, calls = _first_write_pauses_after_it_lands(monkeypatch)
    worker_a = Worker(lambda: action_execute(action_id=action.pk))
    worker_a.start()
    assert sent.wait(WAIT)
    op_a = Operation.objects.get(action=action)
    # A stays paused past its lock TTL and its lease: the lock expires, the
    # reconciler abandons A's operation and requeues the action.
    engine_redis.client().delete(lock_key(action.resource_identifier))
    later = timezone.now() + timedelta(seconds=operation_lease_seconds() + 1)
    assert reconcile(now=later, connection=engine_redis.client())["abandoned"] == 1
    # Worker B replays with the same Idempotency-Key and records the effect.
    assert action_execute(action_id=action.pk) == "applied"
    resume.set()
    assert worker_a.finish() == "superseded"

    assert target.effects == 1 and len(calls) == 2
    action.refresh_from_db()
    assert action.status == "applied"
    assert Operation.objects.filter(action=action, status="done").count() == 1
    op_a.refresh_from_db()
    assert op_a.status == "failed" and op_a.outcome.get("abandoned") is True
    assert AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).count() == 1


def test_a_worker_paused_past_its_lock_s_ttl_never_puts_the_mirror_behind_a_newer_write(
    world: Any, engine_redis: Any, target: TargetServer, settings: Any, monkeypatch: Any
) -> None:
    """Worker A's write lands at the target (version 5), then A pauses past its lock's TTL
    (not past its lease: the reconciler has not closed its operation). Another action takes
    the lock with a newer fence, writes version 6 and records the mirror. A resumes and
    records its own effect — true: it did land — but the mirror keeps version 6 (the fence
    checked at the mirror row), never version 5 with A's document."""
    action = _queued_http_write(world, target, settings)
    sent, resume, calls = _first_write_pauses_after_it_lands(monkeypatch)
    worker_a = Worker(lambda: action_execute(action_id=action.pk))
    worker_a.start()
    assert sent.wait(WAIT)
    engine_redis.client().delete(lock_key(action.resource_identifier))  # A's TTL passed
    newer: Action = world.propose(
        action.kind, "prod", payload={"severity": "critical"}, observed_version=5
    )
    assert action_execute(action_id=newer.pk) == "applied"
    assert calls[1] > calls[0]  # the newer holder's fence
    resume.set()
    assert worker_a.finish() == "applied"  # A's write did land (version 5), recorded once

    mirror = Resource.objects.get(kind=action.kind, name="prod")
    assert (mirror.token, mirror.document) == ("6", {"severity": "critical"})
    assert target.effects == 2
    for each in (action, newer):
        each.refresh_from_db()
        assert each.status == "applied"
        assert AuditEvent.objects.filter(event_type="write.applied", action_id=each.pk).count() == 1


def test_a_stale_http_worker_resuming_with_a_retry_does_not_steal_the_new_claim(
    world: Any, engine_redis: Any, target: TargetServer, settings: Any, monkeypatch: Any
) -> None:
    from engine.targets.http_etag import HttpEtagTarget

    action = _queued_http_write(world, target, settings)
    target.fail_next(503)  # worker A is told "try later" ...

    real_write = HttpEtagTarget.write
    answered = threading.Event()
    resume = threading.Event()

    def write(self: Any, *args: Any, **kwargs: Any) -> Any:
        response = real_write(self, *args, **kwargs)
        answered.set()
        assert resume.wait(WAIT)  # ... and is paused before it acts on the answer
        return response

    monkeypatch.setattr(HttpEtagTarget, "write", write)
    worker_a = Worker(lambda: action_execute(action_id=action.pk))
    worker_a.start()
    assert answered.wait(WAIT)
    later = timezone.now() + timedelta(seconds=operation_lease_seconds() + 1)
    assert reconcile(now=later, connection=engine_redis.client())["abandoned"] == 1
    # Worker B claims the requeued action (its operation is pending, not yet sent).
    op_b = open_operation(action_id=action.pk, fence=next_fence(), worker="b", lease_seconds=30)
    resume.set()
    worker_a.finish()

    action.refresh_from_db()
    assert action.status == "executing" and action.not_before is None
    assert Operation.objects.get(pk=op_b.pk).status == "pending"
    assert not AuditEvent.objects.filter(
        event_type="action.retry_scheduled", action_id=action.pk
    ).exists()


def test_an_http_write_claimed_before_an_engage_is_not_sent_after_it(
    world: Any, engine_redis: Any, target: TargetServer, monkeypatch: Any
) -> None:
    """An external target has no barrier transaction: the switch is re-checked right
    before sending. The engage is forced between the worker's claim and its send."""
    from approvals.services import attempts

    kind = world.kind("ext-policy", update="recompute_field", target_url=target.url)
    target.seed("prod", {"severity": "high"}, version=4)
    action = world.propose(kind, "prod", payload={"severity": "low"}, observed_version=4)
    real_notify = attempts.notify_action_changed_now

    def claimed_then_engaged(action_id: Any) -> None:
        real_notify(action_id)
        kill_switch_set(
            scope="ext-policy/*",
            engaged=True,
            reason="incident",
            actor=Actor.person(world.operator),
        )

    monkeypatch.setattr(attempts, "notify_action_changed_now", claimed_then_engaged)
    assert action_execute(action_id=action.pk) == "paused"
    action.refresh_from_db()
    assert action.status == "paused" and action.paused_reason == "incident"
    assert target.requests == [] and target.effects == 0
    assert Operation.objects.get(action=action).status == "failed"
