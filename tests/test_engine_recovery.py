"""Duplicate deliveries across workers, a busy lock, the reconcile command, housekeeping."""

from __future__ import annotations

import io
import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from approvals.models import Action, Operation
from approvals.outbox import engine_redis, enqueue_action_execution
from approvals.services.execution import action_execute
from approvals.services.housekeeping import housekeeping_run
from approvals.services.reconcile import reconcile
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.lock import FencedLock
from ownership.models import OwnershipRecord, Resource, ResourceVersion
from tests.fixtures.engine import wait_for


def _status(action: Action) -> str:
    return Action.objects.values_list("status", flat=True).get(pk=action.pk)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_every_job_delivered_three_times_to_two_workers_applies_once(
    engine_world: Any, rq_worker: Any
) -> None:
    actions = [engine_world.proposed_update(f"r{i}", {"n": 0}, {"n": i}) for i in range(8)]
    for _ in range(2):
        for action in actions:
            enqueue_action_execution(action.pk)
    workers = [rq_worker(), rq_worker()]
    wait_for(lambda: all(_status(a) == "applied" for a in actions), timeout=40)
    wait_for(lambda: engine_redis().llen("rq:queue:default") == 0, timeout=20)
    assert (
        ResourceVersion.objects.filter(resource__kind_id="cfg").count() == 16
    )  # seed + one write each
    assert AuditEvent.objects.filter(event_type="write.applied").count() == 8
    assert AuditEvent.objects.filter(event_type="conflict.opened").count() == 0, workers[0].output()
    assert Operation.objects.filter(status="done").count() == 8


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_busy_lock_keeps_the_action_queued_and_a_scheduled_retry_applies_it(
    engine_world: Any, rq_worker: Any
) -> None:
    action = engine_world.proposed_update("busy", {"n": 0}, {"n": 1})
    holder = FencedLock(engine_redis(), key="cfg/busy", ttl_ms=10_000)
    holder.acquire()
    # no worker yet: run the delivery here, against the held lock
    assert action_execute(action_id=action.pk) == "lock_busy"
    action.refresh_from_db()
    assert action.status == "queued" and action.attempts == 1 and action.not_before is not None
    holder.release()
    worker = rq_worker()
    wait_for(lambda: _status(action) == "applied", timeout=20)
    assert ResourceVersion.objects.filter(resource__name="busy").count() == 2, worker.output()


@pytest.mark.django_db(transaction=True)
def test_the_reconcile_command_resends_a_lost_job(engine_world: Any, engine_redis: Any) -> None:
    action = engine_world.proposed_create("lost", {"ip": "10.9.9.9"})
    engine_redis.client().flushall()
    Action.objects.filter(pk=action.pk).update(updated_at=timezone.now() - timedelta(seconds=10))
    out = io.StringIO()
    call_command("reconcile", stdout=out)
    assert json.loads(out.getvalue())["reconcile"]["requeued"] == 1
    assert engine_redis.client().llen("rq:queue:default") == 1
    out = io.StringIO()
    call_command("reconcile", "--housekeeping", stdout=out)
    result = json.loads(out.getvalue())
    assert result["reconcile"]["requeued"] == 0 and "housekeeping" in result


@pytest.mark.django_db
def test_housekeeping_expires_leases_and_closes_undo_windows_once(
    engine_world: Any, engine_redis: Any
) -> None:
    action = engine_world.proposed_update("a", {"n": 0}, {"n": 1})
    kind = action.kind
    assert action_execute(action_id=action.pk) == "applied"
    lease = OwnershipRecord.objects.create(
        run=engine_world.run,
        kind=kind,
        name="a",
        operations=["update"],
        exclusive=True,
        fence=1,
        expires_at=timezone.now() + timedelta(minutes=5),
    )
    later = timezone.now() + timedelta(hours=2)
    counts = housekeeping_run(now=later)
    assert counts["undo_windows_closed"] == 1
    assert counts["runs_expired"] >= 1
    lease.refresh_from_db()
    assert lease.active is False
    assert housekeeping_run(now=later)["undo_windows_closed"] == 0
    assert AuditEvent.objects.filter(event_type="undo.window_closed").count() == 1
    assert Resource.objects.get(name="a").document == {"n": 1}


@pytest.mark.django_db
def test_reconcile_takes_back_an_operation_whose_lease_expired(
    engine_world: Any, engine_redis: Any
) -> None:
    from engine.core.fence import next_fence
    from engine.core.operations import open_operation

    action = engine_world.proposed_update("a", {"n": 0}, {"n": 1})
    operation = open_operation(
        action_id=action.pk, fence=next_fence(), worker="ghost", lease_seconds=5
    )
    assert reconcile()["abandoned"] == 0  # the lease is still running
    assert reconcile(now=timezone.now() + timedelta(seconds=6))["abandoned"] == 1
    operation.refresh_from_db()
    assert operation.status == "failed" and operation.outcome["abandoned"] is True
    assert _status(action) == "queued"
    # the ghost wakes up and tries to write with its old operation: refused, nothing written
    from audit.services import Actor
    from engine.core.barrier import apply_action

    outcome = apply_action(
        action_id=action.pk, operation_id=operation.pk, fence=operation.fence, actor=Actor.system()
    )
    assert outcome.applied is False
    assert action_execute(action_id=action.pk) == "applied"
    assert ResourceVersion.objects.filter(resource__name="a").count() == 2


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_cron_process_reconciles_on_its_own_after_a_flushall(
    engine_world: Any, engine_redis: Any, rq_worker: Any, tmp_path: Any
) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    action = engine_world.proposed_create("orphan", {"ip": "10.7.7.7"})
    engine_redis.client().flushall()
    worker = rq_worker()
    log = (tmp_path / "cron.log").open("wb")
    cron = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "rqcron", "approvals.cron"],
        env=subprocess_env(REDIS_URL=engine_redis.url),
        cwd=str(ROOT),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: _status(action) == "applied", timeout=30)
    finally:
        cron.terminate()
        cron.wait(timeout=10)
        log.close()
    assert ResourceVersion.objects.filter(resource__name="orphan").count() == 1, worker.output()


@pytest.mark.django_db
def test_an_action_that_keeps_losing_its_worker_fails_instead_of_looping(
    engine_world: Any, engine_redis: Any
) -> None:
    from approvals.services.attempts import max_attempts
    from engine.core.fence import next_fence
    from engine.core.operations import open_operation

    action = engine_world.proposed_update("poison", {"n": 0}, {"n": 1})
    Action.objects.filter(pk=action.pk).update(attempts=max_attempts() - 1)
    open_operation(action_id=action.pk, fence=next_fence(), worker="ghost", lease_seconds=1)
    assert reconcile(now=timezone.now() + timedelta(seconds=5))["abandoned"] == 0
    action.refresh_from_db()
    assert action.status == "failed" and action.error["code"] == "worker_lost"


@pytest.mark.django_db
def test_a_retry_stuck_in_rq_scheduling_is_resent_once_overdue(
    engine_world: Any, engine_redis: Any, django_capture_on_commit_callbacks: Any
) -> None:
    from approvals.services.attempts import action_retry_later

    action = engine_world.proposed_update("later", {"n": 0}, {"n": 1})
    with django_capture_on_commit_callbacks(execute=True):
        assert action_retry_later(action_id=action.pk, reason="lock_busy") == "queued"
    registry = engine_redis.client().zcard("rq:scheduled:default")
    assert registry == 1
    soon = timezone.now() + timedelta(seconds=5)
    assert reconcile(now=soon)["requeued"] == 0  # the scheduled retry is still coming
    much_later = timezone.now() + timedelta(seconds=120)
    assert reconcile(now=much_later)["requeued"] == 1  # nobody ran the scheduler
    assert engine_redis.client().llen("rq:queue:default") >= 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_undo_requests_share_one_undo(engine_world: Any, engine_redis: Any) -> None:
    import threading

    from django.db import connection

    from approvals.services.undo import action_undo_request

    action = engine_world.proposed_update("u", {"n": 0}, {"n": 1})
    assert action_execute(action_id=action.pk) == "applied"
    results: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def request(i: int) -> None:
        try:
            barrier.wait()
            actor = Actor.run(engine_world.run) if i % 2 else Actor.person(engine_world.operator)
            results.append(
                action_undo_request(
                    action_id=action.pk, actor=actor, idempotency_key=f"k-{i:08d}"
                ).pk
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=request, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and len(results) == 6 and len(set(results)) == 1
    assert Operation.objects.filter(action=action, undo_of__isnull=False).count() == 1
    assert AuditEvent.objects.filter(event_type="undo.requested", action_id=action.pk).count() == 1


# Issue 38 §3: no fixed window that parked work can fill. More than the old window (1,000
# oldest rows) of work stays paused behind an engaged switch, waiting for a person.
PARKED = 1_001


def _paused_actions(world: Any, kind: Any, names: list[str], *, status: str) -> list[Action]:
    """Action rows of world's run on kind/<name>, created together (oldest first), paused."""
    base = timezone.now() - timedelta(minutes=10)
    rows = [
        Action(
            run=world.run,
            agent=world.run.agent,
            kind=kind,
            name=name,
            operation="update",
            payload_format="replace",
            payload={"n": 1},
            observed_version=1,
            conflict_class=kind.class_for("update"),
            status=status,
            paused_reason="incident 7" if status == "paused" else "",
            idempotency_key=f"parked-{name}",
        )
        for name in names
    ]
    created = Action.objects.bulk_create(rows)
    for offset, action in enumerate(created):  # proposal order = list order
        Action.objects.filter(pk=action.pk).update(created_at=base + timedelta(milliseconds=offset))
    return created


def _switches(*, engaged: str, released_behind_our_back: str) -> None:
    """`engaged` holds its work; `released_behind_our_back` was engaged when its work
    paused, then its row was released without the service (a restored backup, a manual
    fix): nothing resumes that work but the reconciler."""
    from console.models import KillSwitch

    KillSwitch.objects.create(scope=engaged, engaged=True, reason="incident 7")
    KillSwitch.objects.create(scope=released_behind_our_back, engaged=False, reason="")


@pytest.mark.django_db(transaction=True)
def test_a_paused_action_whose_switch_is_gone_resumes_however_much_work_stays_parked(
    engine_world: Any, engine_redis: Any
) -> None:
    kind = engine_world.kind("cfg", update="recompute_field")
    parked = _paused_actions(
        engine_world, kind, [f"held-{i:04d}" for i in range(PARKED)], status="paused"
    )
    (lost,) = _paused_actions(engine_world, kind, ["free"], status="paused")
    # ... and an approved write whose job Redis lost, queued after all of them.
    (unsent,) = _paused_actions(engine_world, kind, ["unsent"], status="queued")
    Action.objects.filter(pk=lost.pk).update(created_at=timezone.now())  # the newest
    Action.objects.filter(pk=unsent.pk).update(
        created_at=timezone.now(), updated_at=timezone.now() - timedelta(seconds=10)
    )
    _switches(engaged="cfg/held-*", released_behind_our_back="cfg/free")

    counts = reconcile()
    assert counts["resumed"] == 1 and counts["requeued"] == 1, counts
    assert _status(lost) == "queued"
    assert engine_redis.client().llen("rq:queue:default") == 2  # their jobs
    assert Action.objects.filter(pk__in=[a.pk for a in parked], status="paused").count() == PARKED
    assert reconcile()["resumed"] == 0  # once


@pytest.mark.django_db(transaction=True)
def test_a_paused_undo_whose_switch_is_gone_resumes_however_many_undos_stay_parked(
    engine_world: Any, engine_redis: Any
) -> None:
    from engine.core.fence import next_fence

    kind = engine_world.kind("cfg", update="recompute_field")
    names = [f"held-{i:04d}" for i in range(PARKED)] + ["free"]
    applied = _paused_actions(engine_world, kind, names, status="applied")
    fence = next_fence()
    originals = Operation.objects.bulk_create(
        Operation(action=action, fence=fence, status="done", base_version=1, result_version=2)
        for action in applied
    )
    long_ago = timezone.now() - timedelta(minutes=5)
    undos = Operation.objects.bulk_create(
        Operation(
            action=original.action,
            undo_of=original,
            fence=fence,
            status="pending",
            paused_reason="incident 7",
            accepted_at=long_ago + timedelta(seconds=i),  # the lost one accepted last
        )
        for i, original in enumerate(originals)
    )
    Operation.objects.filter(pk__in=[u.pk for u in undos]).update(started_at=long_ago)
    _switches(engaged="cfg/held-*", released_behind_our_back="cfg/free")

    counts = reconcile()
    assert counts["resumed"] == 1 and counts["undo_requeued"] == 1, counts
    lost = Operation.objects.get(pk=undos[-1].pk)
    assert lost.status == "pending" and lost.paused_reason == ""
    assert (
        Operation.objects.filter(
            pk__in=[u.pk for u in undos[:-1]], paused_reason="incident 7"
        ).count()
        == PARKED
    )
    assert reconcile()["undo_requeued"] == 0  # its job is pending now


@pytest.mark.django_db(transaction=True)
def test_the_reconcilers_switch_filter_is_exactly_kill_switch_covers(
    engine_world: Any, engine_redis: Any
) -> None:
    """What the reconciler resumes is chosen in SQL now: it must leave out exactly what
    KillSwitch.covers says a switch holds (LIKE's own wildcards in a name included)."""
    from console.models import KillSwitch

    kind = engine_world.kind("cfg", update="recompute_field")
    names = ["a%b", "axb", "a_c", "abc", "zeta", "z", "held-1", "held"]
    paused = _paused_actions(engine_world, kind, names, status="paused")
    for scope in ("cfg/a%*", "cfg/a_c", "cfg/z*", "cfg/held-*"):
        KillSwitch.objects.create(scope=scope, engaged=True, reason="incident 7")
    switches = list(KillSwitch.objects.filter(engaged=True))
    expected = {
        a.name for a in paused if not any(s.covers(a.resource_identifier) for s in switches)
    }
    assert expected == {"axb", "abc", "held"}
    reconcile()
    resumed = set(Action.objects.filter(status="queued").values_list("name", flat=True))
    assert resumed == expected
