"""airlock-client against a live Airlock (uvicorn, PostgreSQL, a private Redis and a real
RQ worker): the design's collision, a per-call approval, a rejection, a retried write whose
first response was lost, undo, and the async client's surface."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import airlock_client
import pytest
from airlock_client import (
    Airlock,
    AsyncAirlock,
    OutsideWriteSet,
    RunNotApproved,
    RunSession,
    StaleVersion,
)

from approvals.models import Action
from ownership.models import Resource as ResourceRow
from tests.client.conftest import POLICY, POLICY_WRITE_SET, Live
from tests.client.proxy import DroppingProxy
from tests.test_api_longpoll import wait_until_held

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def apply_severity_change(live: Live, token: str) -> None:
    """Agent B: its own run, a per-call approved merge patch, applied, run finished."""
    with Airlock(live.url, token) as airlock:
        live.approve_next_run_of(token)
        with airlock.start_run("raise severity for INC-4711", POLICY_WRITE_SET) as run:
            policy = run.read(POLICY)
            action = run.patch(policy, {"severity": "critical"}, reason="INC-4711")
            live.decide(action=action.id)
            assert run.wait(action, timeout=60).status == "applied"
        assert run.run.status == "finished"


def test_the_design_collision_refuses_the_stale_agent_who_re_reads_re_plans_and_is_applied(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    agent_a = Airlock(live.url, agent_tokens["alerts-bot-a"])
    seen_by_a = agent_a.read(POLICY)
    assert seen_by_a.etag == '"41"'
    apply_severity_change(live, agent_tokens["alerts-bot-b"])  # 41 -> 42

    live.approve_next_run_of(agent_tokens["alerts-bot-a"])
    with agent_a.start_run("add a backup destination", POLICY_WRITE_SET) as run:
        planned = {**seen_by_a.document, "channels": ["email", "pager"]}
        with pytest.raises(StaleVersion) as refused:
            run.put(seen_by_a, planned, reason="add a backup destination")
        assert refused.value.status == 412
        assert refused.value.expected_etag == '"41"'
        assert refused.value.current_etag == '"42"'
        assert refused.value.resolver == "group:operators"
        assert refused.value.conflict_class == "replace_shared_document"
        assert refused.value.queued_action is None  # B's write applied: plainly stale
        # Re-read, re-plan on the current document, propose again.
        current = run.read(POLICY)
        replanned = {**current.document, "channels": ["email", "pager"]}
        action = run.put(current, replanned, reason="add a backup destination (re-planned)")
        assert action.status == "pending_approval"
        live.decide(action=action.id)
        applied = run.wait(action, timeout=60)
    assert applied.status == "applied" and applied.result_etag == '"43"'
    row = ResourceRow.objects.get(kind_id="notification-policy", name="prod-alerts")
    assert row.version == 43
    assert row.document["severity"] == "critical"  # B's change survived
    assert row.document["channels"] == ["email", "pager"]  # A's change applied
    agent_a.close()


@contextlib.contextmanager
def alerts_bot_a_run(live: Live, agent_tokens: dict[str, str], task: str) -> Iterator[RunSession]:
    """A run of alerts-bot-a over the policy, approved by a person; finished and the
    client closed on exit."""
    live.approve_next_run_of(agent_tokens["alerts-bot-a"])
    with (
        Airlock(live.url, agent_tokens["alerts-bot-a"]) as airlock,
        airlock.start_run(task, POLICY_WRITE_SET) as run,
    ):
        yield run


def patch_policy(run: RunSession, patch: dict[str, Any], reason: str) -> airlock_client.Action:
    """A merge patch of the policy as read now."""
    return run.patch(run.read(POLICY), patch, reason=reason)


def test_a_per_call_approval_is_waited_for_by_long_poll_and_applied(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    with alerts_bot_a_run(live, agent_tokens, "tune escalation") as run:
        action = patch_policy(run, {"escalation": {"after_minutes": 5}}, "faster pages")
        assert action.status == "pending_approval"
        # Short wait: still pending, answered with its state (not an error).
        still = run.wait(action, timeout=1.5)
        assert still.status == "pending_approval" and not still.final
        result: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: result.update(action=run.wait(action, timeout=60)), daemon=True
        )
        waiter.start()
        wait_until_held(live.url, 1, waiter)  # the client's long-poll is held by the server
        live.decide(action=action.id, comment="ok")
        waiter.join(timeout=60)
    assert result["action"].status == "applied"
    assert result["action"].approval["by"] == "ana"


def test_a_rejection_is_read_back_with_its_comment(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    with alerts_bot_a_run(live, agent_tokens, "silence prod alerts") as run:
        action = patch_policy(run, {"channels": []}, "too noisy")
        live.decide(action=action.id, decision="reject", comment="never silence prod")
        rejected = run.wait(action, timeout=30)
    assert rejected.status == "rejected"
    assert rejected.rejection_comment == "never silence prod"
    assert ResourceRow.objects.get(name="prod-alerts").version == 41


def test_a_rejected_run_raises_run_not_approved_with_the_reason(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    airlock = Airlock(live.url, agent_tokens["alerts-bot-a"])
    run = airlock.start_run("rewrite everything", POLICY_WRITE_SET, approval_timeout=0)
    assert run.run.status == "pending_approval"
    threading.Thread(
        target=live.decide, kwargs={"run": run.id, "decision": "reject", "comment": "no"}
    ).start()
    with pytest.raises(RunNotApproved) as refused:
        run.wait_for_approval(timeout=30)
    assert refused.value.run.status == "rejected"
    assert refused.value.run.status_reason == "no"
    airlock.close()


def test_a_write_retried_after_its_response_was_lost_creates_one_action(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    proxy = DroppingProxy(live.url, drop_first=b"PATCH ")
    try:
        airlock = Airlock(proxy.url, agent_tokens["alerts-bot-a"])
        live.approve_next_run_of(agent_tokens["alerts-bot-a"])
        with airlock.start_run("tune escalation", POLICY_WRITE_SET) as run:
            policy = run.read(POLICY)
            action = run.patch(policy, {"escalation": {"after_minutes": 10}}, reason="retry me")
            assert proxy.dropped == 1  # the first answer never reached the client
            assert proxy.requests_seen(b"PATCH ") == 2  # so it sent the same write again
            assert action.replayed  # ... and the server replayed its first answer
            assert Action.objects.filter(run_id=run.id).count() == 1
            keys = set(Action.objects.filter(run_id=run.id).values_list("idempotency_key"))
            assert len(keys) == 1
        airlock.close()
    finally:
        proxy.close()


def test_undo_restores_the_previous_document(live: Live, agent_tokens: dict[str, str]) -> None:
    with alerts_bot_a_run(live, agent_tokens, "tune escalation") as run:
        before = run.read(POLICY)
        action = run.patch(before, {"escalation": {"after_minutes": 1}}, reason="undo me")
        live.decide(action=action.id)
        assert run.wait(action, timeout=60).status == "applied"
        undone = run.undo(action, wait=60)
        assert undone.status == "undone"
        after = run.read(POLICY)
    assert after.document == before.document
    assert after.version == 43  # the undo is a new version with the old document


def test_a_write_outside_the_write_set_raises_outside_write_set(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    airlock = Airlock(live.url, agent_tokens["dns-bot"])
    live.approve_next_run_of(agent_tokens["dns-bot"])
    with airlock.start_run("add app records", [("dns-record/app-*", ["create"])]) as run:
        policy = run.read(POLICY)
        with pytest.raises(OutsideWriteSet) as refused:
            run.patch(policy, {"severity": "low"})
    assert refused.value.resource == POLICY and refused.value.operation == "update"
    airlock.close()


def test_the_async_client_has_the_same_surface(live: Live, agent_tokens: dict[str, str]) -> None:
    async def scenario() -> tuple[str, str, Any]:
        async with AsyncAirlock(live.url, agent_tokens["dns-bot"]) as airlock:
            live.approve_next_run_of(agent_tokens["dns-bot"])
            run = await airlock.start_run(
                "add app records", [("dns-record/app-*", ["create", "update"])]
            )
            async with run:
                created = await run.create("dns-record/app-1", {"type": "A", "ip": "10.0.0.1"})
                created = await run.wait(created, timeout=60)
                record = await run.read("dns-record/app-1")
                updated = await run.patch(record, {"ip": "10.0.0.2"})
                updated = await run.wait(updated, timeout=60)
                listed = await run.actions()
            return created.status, updated.status, (run.run.status, len(listed))

    created, updated, (run_status, listed) = asyncio.run(scenario())
    assert (created, updated) == ("applied", "applied")  # per-run classes: no per-call step
    assert run_status == "finished" and listed == 2
    assert ResourceRow.objects.get(name="app-1").document == {"type": "A", "ip": "10.0.0.2"}
