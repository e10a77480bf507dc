"""A plan step whose write is settled `applied` late (issue 39): step 2 of a plan writes a
real PostgreSQL row through a TCP link the test breaks; its only attempt's answer is lost
after the row was updated, and the target is unreachable for its last read, so the step's
action ends `failed` with its outcome unknown. The plan stops and compensates step 1. Later
the periodic re-read finds step 2's write did take effect:

- the plan stopped (compensated): it is reopened, the step recorded `applied` with
  `settled_late`, audited `plan.step_settled_late`, and compensated by an undo conditional
  on the version it wrote — end to end with the Procfile's `cron` and a real worker; the
  plan's API representation and page show it as any compensation;
- someone changed the row after the re-read: that compensation is a conflict for a person,
  never an overwrite (the plan `partially_compensated`);
- the plan still compensating (step 1's undo queued): step 2 joins the compensation, step
  1's is neither redone nor dropped;
- the plan still going forward (not yet told its step failed): it reads the step's action
  `applied` as any step's and goes on — nothing to compensate.

Step 1 writes another row of the same table reached directly (tests/fixtures/last_read.py
`plan_rows`), so that breaking the link only touches step 2.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from approvals.models import Action, Operation, Plan, PlanStep
from approvals.services.execution import action_execute
from approvals.services.plan_engine import plan_advance
from approvals.services.reread import RESULTS, reread_unsettled
from approvals.services.undo import undo_execute
from audit.models import AuditEvent
from ownership.models import Conflict
from tests.conftest import ROOT, subprocess_env
from tests.fixtures import plans as plan_fx
from tests.fixtures.api import make_active_run, make_agent_with_token
from tests.fixtures.console import client_for
from tests.fixtures.engine import wait_for, wait_until_due
from tests.fixtures.last_read import PlanRows
from tests.fixtures.targets import row, someone_updates_row

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

NOTHING = dict.fromkeys(RESULTS, 0)
GLOBEX = "ledger-account/globex"  # step 1, reached directly
ACME = "billing-account/acme"  # step 2, through the link


def _run() -> Any:
    agent = make_agent_with_token(f"late-bot-{uuid.uuid4().hex[:6]}")
    ops = ["create", "update", "delete"]
    write_set = [{"resource": GLOBEX, "operations": ops}, {"resource": ACME, "operations": ops}]
    return make_active_run(agent.agent, write_set)


def _step(plan_id: str, position: int) -> PlanStep:
    return PlanStep.objects.select_related("action").get(plan_id=plan_id, position=position)


def _action(plan_id: str, position: int) -> Action:
    action = _step(plan_id, position).action
    assert action is not None
    return action


def _plan_events(plan_id: str, event_type: str) -> list[AuditEvent]:
    return list(
        AuditEvent.objects.filter(event_type=event_type, details__plan=plan_id).order_by("seq")
    )


def _step_2_left_unknown(api: Any, settings: Any, rows: PlanRows, run: Any) -> str:
    """The plan proposed; step 1 applied; step 2's UPDATE reaches the row and its answer is
    lost, then the target is unreachable for its last read: step 2's action `failed`, its
    outcome unknown. Driven in this process (a worker would race the link's cut); the plan
    itself has not been told yet (its job was not run)."""
    settings.AIRLOCK_MAX_ATTEMPTS = 1
    settings.AIRLOCK_BACKOFF_BASE_SECONDS = 0.05
    link = rows.linked.link
    assert link is not None
    plan_id = plan_fx.proposed_plan(
        api,
        run,
        [
            plan_fx.patch_step(GLOBEX, '"1"', {"seats": 4}),
            plan_fx.patch_step(ACME, '"1"', {"seats": 9}),
        ],
    )
    assert plan_advance(plan_id=plan_id) == "started:1"
    assert action_execute(action_id=_action(plan_id, 1).pk) == "applied"
    assert plan_advance(plan_id=plan_id) == "started:2"
    second = _action(plan_id, 2)
    link.cut_next(b"UPDATE", deliver=True)
    assert action_execute(action_id=second.pk) == "unknown"
    link.down()
    wait_until_due(second)
    assert action_execute(action_id=second.pk) == "failed"
    second.refresh_from_db()
    assert second.error["outcome"] == "unknown" and second.error["last_read"] == "unsettled"
    assert row(rows.linked.url, "acme") == ({"seats": 9}, 2)  # it did land
    return plan_id


def _compensated_in_process(plan_id: str) -> None:
    """The plan told: step 2 refused, step 1 compensated (its undo run here)."""
    assert plan_advance(plan_id=plan_id) == "compensating:1"
    undo_id = _step(plan_id, 1).compensation_operation_id
    assert undo_id is not None
    assert undo_execute(undo_operation_id=undo_id) == "undone"
    assert plan_advance(plan_id=plan_id) == "compensated"


@contextmanager
def _cron(redis_url: str, log_path: Any) -> Iterator[None]:
    """The Procfile's `cron` line (`rqcron approvals.cron`), the re-read every second."""
    log = log_path.open("wb")
    cron = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "rqcron", "approvals.cron"],
        env=subprocess_env(REDIS_URL=redis_url, AIRLOCK_REREAD_EVERY_SECONDS="1"),
        cwd=str(ROOT),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield
    finally:
        cron.terminate()
        cron.wait(timeout=10)
        log.close()


def test_a_compensated_plan_whose_failed_step_is_found_applied_later_compensates_it(
    api: Any,
    engine_redis: Any,
    settings: Any,
    plan_rows: PlanRows,
    rq_worker: Any,
    operator: Any,
    tmp_path: Any,
) -> None:
    rows = plan_rows.linked
    assert rows.link is not None
    run = _run()
    plan_id = _step_2_left_unknown(api, settings, plan_rows, run)
    lost = Operation.objects.get(action=_action(plan_id, 2), status="unknown")

    # The plan is told (step 2 refused) and a real worker compensates step 1, directly;
    # the link is still down, so nothing settles step 2 meanwhile.
    assert plan_advance(plan_id=plan_id) == "compensating:1"
    worker = rq_worker()
    wait_for(lambda: plan_fx.plan_status(plan_id) == "compensated", timeout=60)
    assert row(rows.url, "globex") == ({"seats": 3}, 3)
    # The hole: the plan compensated, step 2's effect still on the target.
    assert row(rows.url, "acme") == ({"seats": 9}, 2)
    assert _step(plan_id, 2).status == "refused"

    # The target answers again: the cron's re-read settles step 2 applied, the plan reopens
    # and the worker compensates step 2 through the link.
    rows.link.up()
    with _cron(engine_redis.url, tmp_path / "cron.log"):
        wait_for(lambda: _step(plan_id, 2).compensation_status == "compensated", timeout=90)
        wait_for(lambda: plan_fx.plan_status(plan_id) == "compensated", timeout=30)
    assert row(rows.url, "acme") == ({"seats": 5}, 3), worker.output()  # ours, then undone
    assert row(rows.url, "globex") == ({"seats": 3}, 3)  # step 1: compensated once

    second = _step(plan_id, 2)
    assert second.status == "applied" and second.applied_operation_id == lost.pk
    assert second.error["code"] == "attempts_exhausted"  # why it was refused stays
    assert second.error["settled_late"]["operation"] == lost.pk
    assert second.error["settled_late"]["result_version"] == "2"
    undo = Operation.objects.get(pk=second.compensation_operation_id)
    assert undo.compensation and undo.status == "done" and undo.base_version == "2"
    lost.refresh_from_db()
    assert lost.status == "undone" and lost.outcome["settled_later"] is True

    [late] = _plan_events(plan_id, "plan.step_settled_late")
    assert late.details["step"] == 2 and late.details["plan_was"] == "compensated"
    assert late.details["operation"] == lost.pk and late.details["result_version"] == "2"
    ended = _plan_events(plan_id, "plan.ended")
    assert [e.details["status"] for e in ended] == ["compensated", "compensated"]
    assert ended[0].seq < late.seq < ended[1].seq
    started = _plan_events(plan_id, "plan.compensation_started")
    assert [e.details["step"] for e in started] == [1, 2]
    undone = AuditEvent.objects.filter(event_type="write.undone")
    for action_id in (_action(plan_id, 1).pk, second.action_id):  # each undone once
        assert undone.filter(action_id=action_id).count() == 1

    # The plan's API representation and page show it as any compensation.
    body = plan_fx.read_plan(api, run.token, plan_id)
    assert body["status"] == "compensated" and body["ended_at"]
    step_2 = body["steps"][1]
    assert step_2["status"] == "applied" and step_2["applied"]["operation"] == lost.pk
    assert step_2["compensation"]["status"] == "compensated"
    assert step_2["compensation"]["undo_operation"] == undo.pk
    assert step_2["error"]["settled_late"]["operation"] == lost.pk
    page = client_for(operator.user).get(f"/plans/{plan_id}/").content.decode()
    assert 'id="plan-step-2-settled-late"' in page
    assert page.count('data-compensation="compensated"') == 2


def test_a_late_step_s_compensation_meeting_someone_s_change_is_a_conflict_not_an_overwrite(
    api: Any, engine_redis: Any, settings: Any, plan_rows: PlanRows
) -> None:
    rows = plan_rows.linked
    assert rows.link is not None
    plan_id = _step_2_left_unknown(api, settings, plan_rows, _run())
    _compensated_in_process(plan_id)
    rows.link.up()

    assert reread_unsettled() == {**NOTHING, "applied": 1, "plans_reopened": 1}
    assert plan_fx.plan_status(plan_id) == "compensating"
    second = _step(plan_id, 2)
    assert (second.status, second.compensation_status) == ("applied", "pending")
    undo_id = second.compensation_operation_id
    assert undo_id is not None
    assert reread_unsettled() == NOTHING  # once: the plan is not reopened twice

    someone_updates_row(rows.url, "acme", {"seats": 7})  # version 3, not ours
    assert undo_execute(undo_operation_id=undo_id) == "conflict"
    assert plan_advance(plan_id=plan_id) == "partially_compensated"
    assert row(rows.url, "acme") == ({"seats": 7}, 3)  # theirs stands
    second = _step(plan_id, 2)
    assert second.compensation_status == "conflict"
    conflict = Conflict.objects.get(action_id=second.action_id, origin="undo")
    assert conflict.status == "open" and conflict.current_version == "3"
    assert _step(plan_id, 1).compensation_status == "compensated"  # not redone
    assert Plan.objects.get(pk=plan_id).ended_at is not None


def test_a_plan_still_going_forward_takes_a_step_settled_late_as_applied(
    api: Any, engine_redis: Any, settings: Any, plan_rows: PlanRows
) -> None:
    """The plan engine reads a step's action when it moves: not yet told that step 2
    failed, the plan finds it `applied` once the re-read settled it, and ends applied —
    nothing was refused, nothing to compensate."""
    rows = plan_rows.linked
    assert rows.link is not None
    plan_id = _step_2_left_unknown(api, settings, plan_rows, _run())
    rows.link.up()
    assert reread_unsettled() == {**NOTHING, "applied": 1}  # a plan going forward: not reopened
    assert plan_fx.plan_status(plan_id) == "executing"
    assert plan_advance(plan_id=plan_id) == "applied"
    assert [_step(plan_id, n).status for n in (1, 2)] == ["applied", "applied"]
    assert not _plan_events(plan_id, "plan.step_settled_late")
    assert not _plan_events(plan_id, "plan.compensation_started")
    assert row(rows.url, "acme") == ({"seats": 9}, 2)
    assert row(rows.url, "globex") == ({"seats": 4}, 2)


def test_a_plan_still_compensating_takes_a_step_settled_late_into_its_compensation(
    api: Any, engine_redis: Any, settings: Any, plan_rows: PlanRows
) -> None:
    """Step 1's compensation is under way (queued, not yet run) when step 2 settles late:
    step 2 is compensated too, and step 1's is neither redone nor dropped."""
    rows = plan_rows.linked
    assert rows.link is not None
    plan_id = _step_2_left_unknown(api, settings, plan_rows, _run())
    assert plan_advance(plan_id=plan_id) == "compensating:1"
    first_undo = _step(plan_id, 1).compensation_operation_id
    rows.link.up()

    assert reread_unsettled() == {**NOTHING, "applied": 1, "plans_reopened": 1}
    assert plan_fx.plan_status(plan_id) == "compensating"
    second = _step(plan_id, 2)
    assert (second.status, second.compensation_status) == ("applied", "pending")
    [late] = _plan_events(plan_id, "plan.step_settled_late")
    assert late.details["plan_was"] == "compensating"
    assert _step(plan_id, 1).compensation_operation_id == first_undo  # the same one

    assert second.compensation_operation_id is not None and first_undo is not None
    assert undo_execute(undo_operation_id=second.compensation_operation_id) == "undone"
    assert undo_execute(undo_operation_id=first_undo) == "undone"
    assert plan_advance(plan_id=plan_id) == "compensated"
    assert row(rows.url, "acme") == ({"seats": 5}, 3)
    assert row(rows.url, "globex") == ({"seats": 3}, 3)
    started = _plan_events(plan_id, "plan.compensation_started")
    assert [e.details["step"] for e in started] == [1, 2]
    assert [e.details["status"] for e in _plan_events(plan_id, "plan.ended")] == ["compensated"]
