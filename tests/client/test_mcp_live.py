"""airlock-mcp driven by the `mcp` SDK's own ClientSession over stdio, against a live
Airlock (uvicorn, PostgreSQL, a private Redis and a real RQ worker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from airlock_client import Airlock
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from ownership.models import Resource as ResourceRow
from tests.client.conftest import CLIENT_SRC, POLICY, Live
from tests.client.test_client_live import apply_severity_change
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

AIRLOCK_MCP = str(Path(sys.executable).parent / "airlock-mcp")


class Tools:
    def __init__(self, session: ClientSession) -> None:
        self.session = session

    async def call(self, name: str, **arguments: Any) -> tuple[bool, Any]:
        """(is_error, the structured result or the error text)."""
        result = await self.session.call_tool(name, arguments, read_timeout_seconds=130)
        text = "".join(getattr(block, "text", "") for block in result.content)
        if result.is_error:
            return True, text
        if isinstance(result.structured_content, dict):
            return False, result.structured_content
        return False, json.loads(text)

    async def ok(self, name: str, **arguments: Any) -> dict[str, Any]:
        is_error, value = await self.call(name, **arguments)
        assert not is_error, value
        assert isinstance(value, dict)
        return value

    async def error(self, name: str, **arguments: Any) -> str:
        is_error, value = await self.call(name, **arguments)
        assert is_error, value
        return str(value)


def with_mcp(live: Live, env: dict[str, str], scenario: Callable[[Tools], Awaitable[None]]) -> None:
    params = StdioServerParameters(
        command=AIRLOCK_MCP,
        env={"AIRLOCK_URL": live.url, "PYTHONPATH": CLIENT_SRC, **env},
        cwd=str(Path.cwd()),
    )

    async def main() -> None:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            await scenario(Tools(session))

    asyncio.run(main())


def test_the_design_collision_played_through_mcp_tools(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    async def scenario(tools: Tools) -> None:
        listed = await tools.session.list_tools()
        names = {tool.name for tool in listed.tools}
        assert {
            "start_run",
            "show_run",
            "read_resource",
            "propose_write",
            "wait_for_action",
            "undo_action",
            "list_actions",
        } <= names
        assert all(tool.description for tool in listed.tools)
        seen = await tools.ok("read_resource", resource=POLICY)
        assert seen["etag"] == '"41"'
        # Meanwhile agent B changes the policy (41 -> 42) with the Python client.
        await asyncio.to_thread(apply_severity_change, live, agent_tokens["alerts-bot-b"])
        live.approve_next_run_of(agent_tokens["alerts-bot-a"])
        run = await tools.ok(
            "start_run",
            task="add a backup destination",
            write_set=[{"resource": POLICY, "operations": ["update"]}],
            wait_seconds=30,
        )
        assert run["status"] == "active"
        planned = {**seen["document"], "channels": ["email", "pager"]}
        message = await tools.error(
            "propose_write", resource=POLICY, operation="replace", document=planned
        )
        assert "Re-read and re-plan" in message
        assert '"42"' in message and '"41"' in message
        assert "group:operators" in message
        current = await tools.ok("read_resource", resource=POLICY)
        assert current["etag"] == '"42"'
        replanned = {**current["document"], "channels": ["email", "pager"]}
        proposed = await tools.ok(
            "propose_write",
            resource=POLICY,
            operation="replace",
            document=replanned,
            reason="add a backup destination",
        )
        assert proposed["status"] == "pending_approval"
        # A per-call approval: a short wait answers "still pending" and what it waits for.
        pending = await tools.ok("wait_for_action", action_id=proposed["action"], wait_seconds=1)
        assert pending["status"] == "pending_approval"
        assert pending["next"].startswith("Still pending")
        assert "approval" in pending["waiting_for"]
        await asyncio.to_thread(live.decide, action=proposed["action"])
        applied = await tools.ok("wait_for_action", action_id=proposed["action"], wait_seconds=60)
        assert applied["status"] == "applied" and applied["result_etag"] == '"43"'
        actions = await tools.ok("list_actions")
        assert [a["action"] for a in actions["actions"]] == [proposed["action"]]
        # The resource template reads the same document.
        read = await tools.session.read_resource(
            "airlock://resources/notification-policy/prod-alerts"
        )
        body = json.loads(getattr(read.contents[0], "text", ""))
        assert body["version"] == 43 and body["document"]["channels"] == ["email", "pager"]
        finished = await tools.ok("finish_run")
        assert finished["status"] == "finished"

    with_mcp(live, {"AIRLOCK_AGENT_TOKEN": agent_tokens["alerts-bot-a"]}, scenario)
    row = ResourceRow.objects.get(name="prod-alerts")
    assert row.version == 43 and row.document["severity"] == "critical"


def test_a_tool_call_outside_the_write_set_is_refused_with_the_missing_entry(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    # Join an existing run with its run token (AIRLOCK_RUN_TOKEN).
    airlock = Airlock(live.url, agent_tokens["dns-bot"])
    live.approve_next_run_of(agent_tokens["dns-bot"])
    run = airlock.start_run("add app records", [("dns-record/app-*", ["create"])])

    async def scenario(tools: Tools) -> None:
        shown = await tools.ok("show_run")
        assert shown["run"] == run.id and shown["status"] == "active"
        assert shown["write_set"] == [{"resource": "dns-record/app-*", "operations": ["create"]}]
        await tools.ok("read_resource", resource=POLICY)
        message = await tools.error(
            "propose_write", resource=POLICY, operation="merge_patch", document={"severity": "low"}
        )
        assert "not_in_write_set" in message
        assert f"'resource': '{POLICY}'" in message and "'operations': ['update']" in message
        # A write never read first is refused before it reaches the server.
        message = await tools.error(
            "propose_write",
            resource="dns-record/app-9",
            operation="replace",
            document={"ip": "10.0.0.9"},
        )
        assert "read_resource first" in message
        created = await tools.ok(
            "propose_write",
            resource="dns-record/app-9",
            operation="create",
            document={"type": "A", "ip": "10.0.0.9"},
        )
        done = await tools.ok("wait_for_action", action_id=created["action"], wait_seconds=60)
        assert done["status"] == "applied"

    with_mcp(live, {"AIRLOCK_RUN_TOKEN": str(run.token)}, scenario)
    assert ResourceRow.objects.get(name="app-9").document == {"type": "A", "ip": "10.0.0.9"}
    airlock.close()


def test_it_serves_the_same_tools_over_streamable_http(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    port = free_port()
    server = subprocess.Popen(
        [AIRLOCK_MCP, "--transport", "streamable-http", "--port", str(port)],
        env={
            **os.environ,
            "AIRLOCK_URL": live.url,
            "PYTHONPATH": CLIENT_SRC,
            "AIRLOCK_AGENT_TOKEN": agent_tokens["alerts-bot-a"],
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert server.poll() is None and time.monotonic() < deadline, "no MCP server"
            time.sleep(0.1)

        async def main() -> dict[str, Any]:
            url = f"http://127.0.0.1:{port}/mcp"
            async with (
                streamable_http_client(url) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                return await Tools(session).ok("read_resource", resource=POLICY)

        seen = asyncio.run(main())
        assert seen["etag"] == '"41"' and seen["resource"] == POLICY
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_plan_is_proposed_and_waited_for_through_the_plan_tools(
    live: Live, agent_tokens: dict[str, str]
) -> None:
    airlock = Airlock(live.url, agent_tokens["alerts-bot-a"])
    live.approve_next_run_of(agent_tokens["alerts-bot-a"])
    run = airlock.start_run(
        "point alerts at the new app",
        [(POLICY, ["update"]), ("dns-record/app-*", ["create"])],
    )

    async def scenario(tools: Tools) -> None:
        listed = await tools.session.list_tools()
        plan_tools = {tool.name: tool for tool in listed.tools}
        assert {"propose_plan", "wait_for_plan"} <= set(plan_tools)
        assert "steps" in plan_tools["propose_plan"].input_schema["properties"]
        create = {"resource": "dns-record/app-new", "operation": "create", "document": {"ip": "9"}}
        patch = {
            "resource": POLICY,
            "operation": "merge_patch",
            "document": {"channels": ["pager"]},
        }
        # A step never read first is refused before it reaches the server, by its number.
        message = await tools.error("propose_plan", steps=[create, patch])
        assert "step 2: read" in message and "read_resource first" in message
        # A stale base: the server's problem, naming the step.
        message = await tools.error(
            "propose_plan", steps=[create, {**patch, "base_etag": '"40"'}], reason="stale"
        )
        assert "Stale write refused (412 stale_version)" in message and '"41"' in message
        outside = {"resource": "dns-record/db-1", "operation": "create", "document": {}}
        message = await tools.error("propose_plan", steps=[outside])
        assert "not_in_write_set" in message and "'resource': 'dns-record/db-1'" in message
        message = await tools.error("propose_plan", steps=[create, create])
        assert "(422 validation_error) (step 2)" in message
        message = await tools.error("propose_plan", steps=[{**create, "document": None}])
        assert "step 1: operation 'create' needs a document" in message
        await tools.ok("read_resource", resource=POLICY)
        back = {"operation": "merge_patch", "document": {"channels": ["email"]}}
        proposed = await tools.ok(
            "propose_plan", steps=[create, {**patch, "compensation": back}], reason="move alerts"
        )
        assert proposed["status"] == "pending_approval"
        assert [s["step"] for s in proposed["steps"]] == [1, 2]
        assert proposed["steps"][1]["based_on"] == '"41"'
        compensations = [s["compensation"] for s in proposed["steps"]]
        assert [(c["method"], c["status"]) for c in compensations] == [
            ("undo", "none"),
            ("PATCH", "none"),
        ]
        pending = await tools.ok("wait_for_plan", plan_id=proposed["plan"], wait_seconds=1)
        assert pending["next"].startswith("Still pending: a person approves the plan")
        await asyncio.to_thread(live.decide, plan=proposed["plan"])
        applied = await tools.ok("wait_for_plan", plan_id=proposed["plan"], wait_seconds=60)
        assert applied["status"] == "applied", applied
        assert [s["status"] for s in applied["steps"]] == ["applied", "applied"]
        assert applied["next"].startswith("Applied: every step, in order")
        assert f'{POLICY} at "42"' in applied["next"]
        message = await tools.error("wait_for_plan", plan_id=str(run.id))
        assert "Not found (404)" in message

    with_mcp(live, {"AIRLOCK_RUN_TOKEN": str(run.token)}, scenario)
    assert ResourceRow.objects.get(name="app-new").document == {"ip": "9"}
    assert ResourceRow.objects.get(name="prod-alerts").document["channels"] == ["pager"]
    airlock.close()
