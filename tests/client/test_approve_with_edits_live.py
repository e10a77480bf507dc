"""Issue 42 §1 through the agent's side, against a live Airlock (uvicorn, PostgreSQL, a
private Redis and a real RQ worker): the client's `wait` on the original action wakes when
a person approves an edited version, follows `superseded_by` and answers the edited
action's result; the MCP server's wait_for_action says it was superseded and by which; the
client's `wait_for_plan` on a plan approved with one step edited follows to the edited
plan's result."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from airlock_client import Airlock, plan_step

from approvals.models import Action
from approvals.models import Plan as PlanRow
from ownership.models import Resource as ResourceRow
from tests.client.conftest import POLICY, Live
from tests.client.test_client_live import alerts_bot_a_run, patch_policy
from tests.client.test_mcp_live import Tools, with_mcp
from tests.client.test_plans_live import WRITE_SET
from tests.test_api_longpoll import wait_until_held

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def approve_with_edits(live: Live, action_id: str, **edit: Any) -> dict[str, Any]:
    """The operator approves `action_id`'s pending approval with `edit` (document or patch)."""
    approval = live._pending_approval(
        lambda item: item.get("action") == action_id, f"action={action_id}", 30
    )
    response = httpx.post(
        f"{live.url}/api/v1/approvals/{approval}/decision",
        headers={"Authorization": f"Bearer {live.operator_token}"},
        json={"decision": "approve_with_edits", "comment": "not critical", **edit},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_the_clients_wait_follows_the_edit_to_the_edited_actions_result(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    with alerts_bot_a_run(live, agent_tokens, "raise severity") as run:
        action = patch_policy(run, {"severity": "critical"}, "INC-1")
        assert action.status == "pending_approval"
        result: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: result.update(action=run.wait(action, timeout=60)), daemon=True
        )
        waiter.start()
        wait_until_held(live.url, 1, waiter)  # the long-poll on the original is held
        answer = approve_with_edits(live, action.id, patch={"severity": "error"})
        waiter.join(timeout=60)
        original = run.wait(action, timeout=1, until=lambda a: True)  # no follow needed
    followed = result["action"]
    assert followed.id == answer["action"] != action.id
    assert followed.status == "applied" and followed.result_etag == '"42"'
    assert followed.edited is not None
    assert followed.edited["by"] == "ana" and followed.edited["supersedes"] == action.id
    assert followed.edited["diff"][0]["path"] == "/severity"
    # `until` that accepts any state still follows: the original answers with the edit's.
    assert original.id == followed.id
    assert Action.objects.get(pk=action.id).status == "superseded"
    assert Action.objects.get(pk=action.id).superseded_by_id is not None
    assert ResourceRow.objects.get(name="prod-alerts").document["severity"] == "error"


def test_mcp_wait_for_action_says_the_write_was_superseded_and_by_which_action(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    async def scenario(tools: Tools) -> None:
        live.approve_next_run_of(agent_tokens["alerts-bot-a"])
        await tools.ok(
            "start_run",
            task="tune severity",
            write_set=[{"resource": POLICY, "operations": ["update"]}],
            wait_seconds=30,
        )
        await tools.ok("read_resource", resource=POLICY)
        proposed = await tools.ok(
            "propose_write",
            resource=POLICY,
            operation="merge_patch",
            document={"severity": "critical"},
        )
        answer = await asyncio.to_thread(
            approve_with_edits, live, proposed["action"], document={"severity": "error"}
        )
        done = await tools.ok("wait_for_action", action_id=proposed["action"], wait_seconds=60)
        assert done["action"] == answer["action"] != proposed["action"]
        assert done["status"] == "applied"
        assert done["edited"]["by"] == "ana"
        assert done["edited"]["supersedes"] == proposed["action"]
        assert f"your action {proposed['action']} was superseded by this one" in done["next"]
        assert answer["action"] in done["next"]
        await tools.ok("finish_run")

    with_mcp(live, {"AIRLOCK_AGENT_TOKEN": agent_tokens["alerts-bot-a"]}, scenario)
    assert ResourceRow.objects.get(name="prod-alerts").document["severity"] == "error"


def test_the_clients_wait_for_plan_follows_an_edited_step_to_the_edited_plans_result(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    token = agent_tokens["alerts-bot-a"]
    live.approve_next_run_of(token)
    with Airlock(live.url, token) as airlock, airlock.start_run("page on-call", WRITE_SET) as run:
        policy = run.read(POLICY)
        plan = run.propose_plan(
            [plan_step(policy, "PATCH", patch={"severity": "critical"})], reason="page"
        )
        assert plan.pending
        result: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: result.update(plan=run.wait_for_plan(plan, timeout=60)), daemon=True
        )
        waiter.start()
        wait_until_held(live.url, 1, waiter)  # the long-poll on the original is held
        approval = live._pending_approval(
            lambda item: item.get("plan") == plan.id, f"plan={plan.id}", 30
        )
        response = httpx.post(
            f"{live.url}/api/v1/approvals/{approval}/decision",
            headers={"Authorization": f"Bearer {live.operator_token}"},
            json={
                "decision": "approve_with_edits",
                "step": 1,
                "patch": {"severity": "error"},
                "comment": "not critical",
            },
            timeout=10,
        )
        assert response.status_code == 200, response.text
        waiter.join(timeout=60)
        original = airlock.get_plan(plan.id)
    followed = result["plan"]
    assert followed.id == response.json()["plan"] != plan.id
    assert followed.applied, followed.raw
    assert followed.steps[0].result_etag == '"42"'
    assert followed.edited is not None
    assert followed.edited["by"] == "ana" and followed.edited["supersedes"] == plan.id
    assert followed.edited["step"] == 1
    assert original.status == "superseded" and original.superseded_by == followed.id
    assert original.is_final
    assert PlanRow.objects.get(pk=plan.id).superseded_by_id is not None
    assert ResourceRow.objects.get(name="prod-alerts").document["severity"] == "error"
