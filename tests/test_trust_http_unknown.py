"""A write that may have reached an external target is settled, never silently
cancelled (issue 9, item 3). A real local HTTP target (tests/targetserver.py)
applies the write and answers after the client's timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, Operation, Run
from approvals.services.execution import action_execute
from approvals.services.reconcile import reconcile
from approvals.services.runs import run_expire_due, run_finish, run_revoke
from audit.models import AuditEvent
from audit.services import Actor
from tests.fixtures.engine import ROOT, wait_for
from tests.targetserver import TargetServer


def _status(action: Any) -> str:
    return str(Action.objects.values_list("status", flat=True).get(pk=action.pk))


def _end_run(run: Any, end: str, actor: Any) -> None:
    if end == "finish":
        run_finish(run=run, actor=Actor.run(run))
    elif end == "revoke":
        run_revoke(run=run, actor=Actor.person(actor), reason="stop")
    else:
        Run.objects.filter(pk=run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        assert run_expire_due() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("end", ["finish", "revoke", "expire"])
def test_an_unknown_http_write_survives_the_run_end_and_its_replay_settles_it_once(
    engine_world: Any, engine_redis: Any, target: TargetServer, settings: Any, end: str
) -> None:
    settings.AIRLOCK_TARGET_TIMEOUT_SECONDS = 0.5
    kind = engine_world.hanging_http_kind(target, 1.5)
    action = engine_world.propose(kind, "prod", payload={"n": 2}, observed_version=1)
    assert action_execute(action_id=action.pk) == "unknown"
    assert target.effects == 1

    _end_run(engine_world.run, end, engine_world.operator)
    assert _status(action) == "queued"  # not cancelled, not expired

    action.refresh_from_db()
    delay = (action.not_before - timezone.now()).total_seconds() if action.not_before else 0
    time.sleep(max(delay, 0) + 0.05)
    assert action_execute(action_id=action.pk) == "applied"
    assert _status(action) == "applied"
    assert target.effects == 1
    assert Operation.objects.filter(action=action, status="done").count() == 1
    assert AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).count() == 1


@pytest.mark.django_db
def test_an_http_write_abandoned_in_flight_survives_the_run_end(
    engine_world: Any, engine_redis: Any, target: TargetServer, settings: Any
) -> None:
    from engine.core.operations import open_operation

    settings.AIRLOCK_TARGET_TIMEOUT_SECONDS = 0.5
    kind = engine_world.kind("ext-policy", update="recompute_field", target_url=target.url)
    target.seed("prod", {"n": 1})
    action = engine_world.propose(kind, "prod", payload={"n": 2}, observed_version=1)
    # A worker claimed it and died mid-call; the reconciler takes the operation back.
    open_operation(action_id=action.pk, fence=10_000, worker="dead", lease_seconds=1)
    assert reconcile(now=timezone.now() + timedelta(seconds=30))["abandoned"] == 1
    run_finish(run=engine_world.run, actor=Actor.run(engine_world.run))
    assert _status(action) == "queued"
    Action.objects.filter(pk=action.pk).update(not_before=None)
    assert action_execute(action_id=action.pk) == "applied"
    assert target.effects == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_settles_a_timed_out_http_write_after_the_run_finished(
    engine_world: Any, target: TargetServer, hanging_write: Any
) -> None:
    # A long first backoff: the run finishes while the write waits for its replay.
    action, worker = hanging_write(
        2.0,
        AIRLOCK_TARGET_TIMEOUT_SECONDS="0.5",
        AIRLOCK_BACKOFF_BASE_SECONDS="3",
        AIRLOCK_BACKOFF_CAP_SECONDS="3",
    )
    wait_for(lambda: Operation.objects.filter(action=action, status="unknown").exists())
    run_finish(run=engine_world.run, actor=Actor.run(engine_world.run))
    wait_for(lambda: _status(action) in ("applied", "conflict", "cancelled"), timeout=30)
    assert _status(action) == "applied", worker.output()
    assert target.effects == 1
    assert len({request["key"] for request in target.requests}) == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_operation_lease_is_renewed_while_the_target_call_runs(
    target: TargetServer, hanging_write: Any
) -> None:
    # The target answers inside the 1.4 s timeout, after a few heartbeats.
    action, worker = hanging_write(
        1.3, AIRLOCK_LOCK_TTL_MS="1500", AIRLOCK_TARGET_TIMEOUT_SECONDS="1.4"
    )
    wait_for(lambda: Operation.objects.filter(action=action).exists())
    first_lease = Operation.objects.get(action=action).lease_expires_at
    wait_for(lambda: _status(action) == "applied", timeout=30)
    operation = Operation.objects.get(action=action)
    assert operation.status == "done", worker.output()
    assert first_lease is not None and operation.lease_expires_at > first_lease
    assert target.effects == 1


def test_settings_refuse_a_lock_ttl_shorter_than_the_target_timeout() -> None:
    from tests.conftest import subprocess_env

    result = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        env=subprocess_env(AIRLOCK_LOCK_TTL_MS="1000", AIRLOCK_TARGET_TIMEOUT_SECONDS="5"),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "AIRLOCK_LOCK_TTL_MS (1000) is shorter than AIRLOCK_TARGET_TIMEOUT_SECONDS" in (
        result.stderr
    )
