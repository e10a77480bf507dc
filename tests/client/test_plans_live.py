"""Plans through airlock-client against a live Airlock (uvicorn, PostgreSQL, a private
Redis and a real RQ worker): a two-step plan approved as one and applied in order, a
proposal retried with its key recorded once, a later step refused as stale compensating
the earlier ones, bad plans refused with the step they name, and the async surface.

The write set covers notification-policy/prod-alerts (update: per-call, so a plan with
it waits for one approval) and dns-record/app-* (per-run classes: no approval)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from airlock_client import (
    Airlock,
    AsyncAirlock,
    OutsideWriteSet,
    RunSession,
    StaleVersion,
    ValidationError,
    plan_step,
)

from approvals.models import Plan as PlanRow
from ownership.models import Resource as ResourceRow
from ownership.models import ResourceVersion
from tests.client.conftest import POLICY, Live
from tests.fixtures.core import make_resource

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WRITE_SET = [(POLICY, ["update"]), ("dns-record/app-*", ["create", "update"])]


@contextlib.contextmanager
def started(live: Live, token: str, task: str) -> Iterator[tuple[Airlock, RunSession]]:
    """The agent's client and a run over WRITE_SET that a person approved; the run
    finished and the client closed on exit."""
    live.approve_next_run_of(token)
    with Airlock(live.url, token) as airlock, airlock.start_run(task, WRITE_SET) as run:
        yield airlock, run


def test_a_two_step_plan_is_approved_once_waited_for_and_applied_in_order(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    token = agent_tokens["alerts-bot-a"]
    with started(live, token, "point alerts at the new app") as (airlock, run):
        policy = run.read(POLICY)
        steps = [
            plan_step("dns-record/app-new", "PUT", document={"ip": "10.0.0.9"}, create=True),
            plan_step(policy, "PATCH", patch={"channels": ["pager"]}),
        ]
        plan = run.propose_plan(steps, reason="move alerts to app-new")
        assert plan.pending and not plan.is_final and plan.etag
        assert [(s.position, s.status) for s in plan.steps] == [(1, "pending"), (2, "pending")]
        assert plan.steps[1].observed_etag == '"41"'
        # A short wait answers the pending plan (not an error).
        still = run.wait_for_plan(plan, timeout=1.5)
        assert still.pending and still.approval and still.approval["status"] == "pending"
        waited: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: waited.update(plan=run.wait_for_plan(plan, timeout=60)), daemon=True
        )
        waiter.start()
        live.decide(plan=plan.id, comment="one change, two writes")
        waiter.join(timeout=60)
        done = waited["plan"]
        assert done.applied and done.is_final, done.raw
        assert [s.status for s in done.steps] == ["applied", "applied"]
        assert [s.result_etag for s in done.steps] == ['"1"', '"42"']
        fences = [s.applied["fence"] for s in done.steps if s.applied]
        assert fences == sorted(fences) and len(fences) == 2
        assert all(s.action_id for s in done.steps)
        # The agent token reads the same plan.
        assert airlock.get_plan(plan.id).status == "applied"
        assert airlock.wait_for_plan(plan.id, timeout=5).etag == done.etag
    assert ResourceRow.objects.get(name="app-new").document == {"ip": "10.0.0.9"}
    row = ResourceRow.objects.get(name="prod-alerts")
    assert row.version == 42 and row.document["channels"] == ["pager"]


def test_a_proposal_sent_again_with_its_key_is_answered_from_the_first(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    with started(live, agent_tokens["dns-bot"], "add app records") as (_, run):
        steps = [plan_step("dns-record/app-1", "PUT", document={"ip": "1"}, create=True)]
        first = run.propose_plan(steps, reason="r", idempotency_key="plan-once")
        again = run.propose_plan(steps, reason="r", idempotency_key="plan-once")
        assert (again.id, again.replayed, first.replayed) == (first.id, True, False)
        assert run.wait_for_plan(first, timeout=60).applied
    assert PlanRow.objects.filter(run_id=run.id).count() == 1


def test_a_step_found_stale_at_execution_compensates_the_steps_before_it(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    """dns-record updates are the agent's to retry: a stale step 3 ends the plan
    `compensated`, steps 2 and 1 restored, and the plan names the failed step."""
    make_resource("dns-record/app-c", {"ip": "c"}, version=5)
    with started(live, agent_tokens["alerts-bot-a"], "three writes") as (_, run):
        policy, app_c = run.read(POLICY), run.read("dns-record/app-c")
        plan = run.propose_plan(
            [
                plan_step("dns-record/app-b", "PUT", document={"ip": "b"}, create=True),
                plan_step(policy, "PATCH", patch={"channels": ["pager"]}),
                plan_step(app_c, "PUT", document={"ip": "c2"}),
            ]
        )
        # While a person looks at the plan, someone else moves app-c on.
        ResourceRow.objects.filter(name="app-c").update(document={"ip": "someone"}, version=6)
        ResourceVersion.objects.create(
            resource=ResourceRow.objects.get(name="app-c"),
            version=6,
            document={"ip": "someone"},
            operation="seed",
        )
        live.decide(plan=plan.id)
        ended = run.wait_for_plan(plan, timeout=60)
    assert ended.compensated and ended.is_final, ended.raw
    assert ended.failed_step is not None and ended.failed_step.position == 3
    assert ended.error and ended.error["code"] == "stale_version"
    assert [s.status for s in ended.steps] == ["applied", "applied", "refused"]
    assert [s.compensation_status for s in ended.steps[:2]] == ["compensated"] * 2
    assert ended.conflicts == []
    assert ResourceRow.objects.get(name="app-b").deleted
    assert ResourceRow.objects.get(name="prod-alerts").version == 43  # moved forward
    assert ResourceRow.objects.get(name="app-c").document == {"ip": "someone"}


def test_a_bad_plan_raises_the_problem_naming_its_step_and_records_nothing(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    with started(live, agent_tokens["alerts-bot-a"], "bad plans") as (_, run):
        policy = run.read(POLICY)
        create = plan_step("dns-record/app-1", "PUT", document={"ip": "1"}, create=True)
        with pytest.raises(StaleVersion) as stale:
            run.propose_plan([create, plan_step(POLICY, "PATCH", etag='"40"', patch={"a": 1})])
        assert (stale.value.status, stale.value.step) == (412, 2)
        assert stale.value.current_etag == '"41"' and stale.value.expected_etag == '"40"'
        with pytest.raises(OutsideWriteSet) as outside:
            run.propose_plan([create, plan_step("dns-record/db-1", "DELETE", etag='"1"')])
        assert (outside.value.status, outside.value.step) == (403, 2)
        assert outside.value.resource == "dns-record/db-1"
        with pytest.raises(ValidationError) as duplicate:
            run.propose_plan([plan_step(policy, "PATCH", patch={"a": 1})] * 2)
        assert duplicate.value.status == 422 and duplicate.value.step == 2
        assert duplicate.value.problem_code == "validation_error"
    assert PlanRow.objects.count() == 0
    assert ResourceRow.objects.get(name="prod-alerts").version == 41


def test_the_async_client_proposes_and_waits_for_a_plan(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    token = agent_tokens["dns-bot"]

    async def scenario() -> tuple[str, list[str], str]:
        async with AsyncAirlock(live.url, token) as airlock:
            live.approve_next_run_of(token)
            run = await airlock.start_run("add app records", [("dns-record/app-*", ["create"])])
            async with run:
                plan = await run.propose_plan(
                    [
                        plan_step(f"dns-record/app-{n}", "PUT", document={"n": n}, create=True)
                        for n in (1, 2)
                    ],
                    reason="two records",
                )
                done = await run.wait_for_plan(plan, timeout=60)
                read = await airlock.wait_for_plan(plan.id, timeout=5)
                got = await airlock.get_plan(plan.id)
            return done.status, [s.status for s in done.steps], f"{read.status}/{got.status}"

    status, steps, read = asyncio.run(scenario())
    assert (status, steps, read) == ("applied", ["applied", "applied"], "applied/applied")
    assert ResourceRow.objects.get(name="app-2").document == {"n": 2}
