"""Issue 38 §3: a worker killed (SIGKILL) in the middle of a write — its work is resumed
within 30 s, by the other worker, exactly once.

Everything as deployed: the Procfile's worker class (real subprocesses), the cron process
(`rqcron approvals.cron`: the reconciler every 5 s), production's lock TTL (30 s, so the
lease is 32 s). Before the fix the work waited for the lease to expire (and a delivery
for the dead worker's lock to expire): about 35 s at best.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from approvals.models import Action, Operation
from audit.models import AuditEvent
from ownership.models import ResourceVersion
from tests.conftest import ROOT, subprocess_env
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

RECOVERY_BOUND_SECONDS = 30.0
PRODUCTION_LOCK_TTL = {"AIRLOCK_LOCK_TTL_MS": "30000"}


@pytest.fixture
def cron(engine_redis: Any, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The Procfile's cron process on the private Redis (the reconciler every 5 s)."""
    log = (tmp_path / "cron.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "rqcron", "approvals.cron"],
        env=subprocess_env(REDIS_URL=engine_redis.url, **PRODUCTION_LOCK_TTL),
        cwd=str(ROOT),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield process
    process.terminate()
    process.wait(timeout=10)
    log.close()


def _status(action: Action) -> str:
    return str(Action.objects.values_list("status", flat=True).get(pk=action.pk))


@pytest.mark.parametrize("crash_at", ["after_open_operation", "inside_barrier_before_commit"])
def test_a_write_whose_worker_is_killed_mid_write_is_applied_once_within_30_seconds(
    engine_world: Any, rq_worker: Any, cron: Any, crash_at: str
) -> None:
    kind = engine_world.kind("dns-record", create="add_unique")
    doomed = rq_worker(AIRLOCK_TEST_CRASH_AT=crash_at, **PRODUCTION_LOCK_TTL)
    action = engine_world.propose(kind, "victim", operation="create", payload={"ip": "10.1.1.1"})
    wait_for(lambda: not doomed.alive(), timeout=30, interval=0.01)
    killed_at = time.monotonic()
    assert doomed.process.returncode == -9, doomed.output()
    assert _status(action) == "executing"  # claimed, its lease running, its lock held
    survivor = rq_worker(**PRODUCTION_LOCK_TTL)

    wait_for(lambda: _status(action) == "applied", timeout=RECOVERY_BOUND_SECONDS + 30)
    recovered_after = time.monotonic() - killed_at
    print(f"{crash_at}: applied {recovered_after:.1f} s after the kill")
    assert recovered_after < RECOVERY_BOUND_SECONDS, (recovered_after, survivor.output())
    assert ResourceVersion.objects.filter(resource__kind=kind).count() == 1
    assert AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).count() == 1
    assert Operation.objects.filter(action=action, status="done").count() == 1
    abandoned = Operation.objects.get(action=action, status="failed")
    outcome = abandoned.outcome or {}
    assert outcome["abandoned"] is True
    assert str(outcome["reason"]).startswith("worker gone"), outcome


def test_an_undo_whose_worker_is_killed_mid_write_is_applied_once_within_30_seconds(
    engine_world: Any, rq_worker: Any, cron: Any
) -> None:
    from approvals.services.execution import action_execute
    from approvals.services.undo import action_undo_request
    from audit.services import Actor

    kind = engine_world.kind("cfg", update="recompute_field", owner_group="operators")
    engine_world.resource(kind, "a", {"n": 0})
    action = engine_world.propose(kind, "a", payload={"n": 1}, observed_version=1)
    assert action_execute(action_id=action.pk) == "applied"
    doomed = rq_worker(AIRLOCK_TEST_CRASH_AT="inside_undo_before_commit", **PRODUCTION_LOCK_TTL)
    undo_op = action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator))
    wait_for(lambda: not doomed.alive(), timeout=30, interval=0.01)
    killed_at = time.monotonic()
    assert doomed.process.returncode == -9, doomed.output()
    assert Operation.objects.get(pk=undo_op.pk).status == "pending"  # claimed, lock held
    survivor = rq_worker(**PRODUCTION_LOCK_TTL)

    wait_for(lambda: _status(action) == "undone", timeout=RECOVERY_BOUND_SECONDS + 30)
    recovered_after = time.monotonic() - killed_at
    print(f"undo: applied {recovered_after:.1f} s after the kill")
    assert recovered_after < RECOVERY_BOUND_SECONDS, (recovered_after, survivor.output())
    assert ResourceVersion.objects.filter(action_id=action.pk, operation="undo").count() == 1
    assert AuditEvent.objects.filter(event_type="write.undone", action_id=action.pk).count() == 1
    assert Operation.objects.get(pk=undo_op.pk).status == "done"


def test_a_plan_step_whose_worker_is_killed_mid_write_goes_on_within_30_seconds(
    api: Any, run: Any, plan_world: Any, rq_worker: Any, cron: Any
) -> None:
    """The issue's own case: a plan's step interrupted by SIGKILL (before: re-queued about
    two minutes later). The step's write is an action like any other."""
    from tests.fixtures import plans as plan_fx

    steps = [
        plan_fx.patch_step("dns-record/app-a", '"3"', {"ip": "2"}),
        plan_fx.create_step("dns-record/app-new", {"ip": "9"}),
    ]
    doomed = rq_worker(AIRLOCK_TEST_CRASH_AT="inside_barrier_before_commit", **PRODUCTION_LOCK_TTL)
    plan_id = plan_fx.proposed_plan(api, run, steps)  # per-run classes: it starts at once
    assert plan_fx.plan_status(plan_id) == "executing"
    wait_for(lambda: not doomed.alive(), timeout=30, interval=0.01)
    killed_at = time.monotonic()
    assert doomed.process.returncode == -9, doomed.output()
    survivor = rq_worker(**PRODUCTION_LOCK_TTL)

    wait_for(lambda: plan_fx.plan_status(plan_id) == "applied", timeout=RECOVERY_BOUND_SECONDS + 30)
    recovered_after = time.monotonic() - killed_at
    print(f"plan: applied {recovered_after:.1f} s after the kill")
    assert recovered_after < RECOVERY_BOUND_SECONDS, (recovered_after, survivor.output())
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "2"}
    assert plan_fx.resource_row("dns-record/app-new").document == {"ip": "9"}
    for position in (1, 2):
        action = plan_fx.step_action(plan_id, position)
        assert action is not None
        applied = AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk)
        assert applied.count() == 1
