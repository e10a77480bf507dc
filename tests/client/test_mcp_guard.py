"""airlock-mcp's guards, on the real server process: a model-chosen id never reaches another
endpoint (stdio, behind a recording relay), and the streamable-HTTP transport needs its
bearer token, or binds to loopback only (with a warning)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.client.conftest import CLIENT_SRC, POLICY, Live
from tests.client.relay import Relay
from tests.client.test_mcp_live import AIRLOCK_MCP, Tools, with_mcp
from tests.conftest import free_port
from tests.fixtures.api import make_active_run, make_agent_with_token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_tools_refuse_an_id_or_a_resource_that_could_leave_its_endpoint(
    live_without_worker: Live,
) -> None:
    run = make_active_run(make_agent_with_token("mcp-id-bot").agent)
    relay = Relay(live_without_worker.url, method="NONE", prefix="/", mode="503_after")

    async def scenario(tools: Tools) -> None:
        await tools.ok("show_run")  # joins the run: GET /runs?limit=1, then GET /runs/{id}
        sent = len(relay.seen)
        for bad in ("../../agents", "x?y", "..", "../../runs?status=active"):
            for tool, argument in (
                ("wait_for_action", "action_id"),
                ("undo_action", "action_id"),
                ("wait_for_plan", "plan_id"),
            ):
                message = await tools.error(tool, **{argument: bad, "wait_seconds": 1})
                assert "must be a UUID" in message and "Refused before sending" in message
        for resource in ("../../agents", "notification-policy/..", "./x"):
            message = await tools.error("read_resource", resource=resource)
            assert "must be" in message, message
            message = await tools.error(
                "propose_write", resource=resource, operation="create", document={"a": 1}
            )
            assert "must be" in message, message
        assert relay.seen[sent:] == []  # not one of them reached the server

    try:
        with_mcp(Live(url=relay.url, operator_token=""), {"AIRLOCK_RUN_TOKEN": run.token}, scenario)
    finally:
        relay.close()


@contextlib.contextmanager
def http_mcp(live: Live, *args: str, **env: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    agent = make_agent_with_token(f"mcp-http-bot-{port}")
    process = subprocess.Popen(
        [AIRLOCK_MCP, "--transport", "streamable-http", "--port", str(port), *args],
        env={
            **{k: v for k, v in os.environ.items() if k != "AIRLOCK_MCP_TOKEN"},
            "AIRLOCK_URL": live.url,
            "PYTHONPATH": CLIENT_SRC,
            "AIRLOCK_AGENT_TOKEN": agent.token,
            **env,
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process, port
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()


def wait_listening(process: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        assert process.poll() is None, "airlock-mcp exited"
        assert time.monotonic() < deadline, "airlock-mcp never listened"
        time.sleep(0.1)


def read_policy(port: int, headers: dict[str, str]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        http = create_mcp_http_client(headers=headers)
        async with (
            http,
            streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http) as (r, w),
            ClientSession(r, w) as session,
        ):
            await session.initialize()
            return await Tools(session).ok("read_resource", resource=POLICY)

    return asyncio.run(main())


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream"}


def test_with_a_token_every_http_request_must_carry_it(live_without_worker: Live) -> None:
    token = secrets.token_urlsafe(32)
    with http_mcp(live_without_worker, AIRLOCK_MCP_TOKEN=token) as (process, port):
        wait_listening(process, port)
        url = f"http://127.0.0.1:{port}/mcp"
        for authorization in (None, f"Bearer {token[:-1]}", f"Basic {token}", "Bearer", token):
            headers = dict(MCP_HEADERS)
            if authorization is not None:
                headers["Authorization"] = authorization
            refused = httpx.post(url, json=INITIALIZE, headers=headers, timeout=10)
            assert refused.status_code == 401, (authorization, refused.text)
            assert refused.headers["WWW-Authenticate"].startswith("Bearer")
        refused_get = httpx.get(url, headers=MCP_HEADERS, timeout=10)
        assert refused_get.status_code == 401
        seen = read_policy(port, {"Authorization": f"Bearer {token}"})
        assert seen["etag"] == '"41"' and seen["resource"] == POLICY


def test_the_token_can_be_given_on_the_command_line(live_without_worker: Live) -> None:
    token = secrets.token_urlsafe(24)
    # "--token=VALUE": a token_urlsafe may begin with "-", which argparse takes for an option.
    with http_mcp(live_without_worker, f"--token={token}") as (process, port):
        wait_listening(process, port)
        url = f"http://127.0.0.1:{port}/mcp"
        assert httpx.post(url, json=INITIALIZE, headers=MCP_HEADERS).status_code == 401
        assert read_policy(port, {"Authorization": f"bearer {token}"})["etag"] == '"41"'


def test_a_non_loopback_bind_without_a_token_is_refused(live_without_worker: Live) -> None:
    all_interfaces = "0.0.0.0"  # noqa: S104 - the bind under test, refused
    with http_mcp(live_without_worker, "--host", all_interfaces) as (process, port):
        assert process.wait(timeout=30) == 2
        assert process.stderr is not None
        assert "refusing to serve streamable HTTP on 0.0.0.0 without a token" in (
            process.stderr.read()
        )
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), 1):
        pass


def test_a_token_too_short_is_refused(live_without_worker: Live) -> None:
    with http_mcp(live_without_worker, AIRLOCK_MCP_TOKEN="short") as (process, _):
        assert process.wait(timeout=30) == 2
        assert process.stderr is not None and "at least 16 characters" in process.stderr.read()


def test_without_a_token_it_serves_loopback_only_and_warns(live_without_worker: Live) -> None:
    with http_mcp(live_without_worker) as (process, port):
        wait_listening(process, port)
        assert read_policy(port, {})["etag"] == '"41"'
        process.terminate()
        process.wait(timeout=10)
        assert process.stderr is not None
        assert "WARNING: serving streamable HTTP on 127.0.0.1 without a token" in (
            process.stderr.read()
        )
