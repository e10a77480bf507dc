"""A live Airlock for the client and MCP tests: uvicorn serving the app on the test
database, a private redis-server and a real RQ worker (`live`), plus people, agents and
the design's resource (notification-policy/prod-alerts at version 41)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.api import (
    ensure_api_kinds,
    make_agent_with_token,
    make_person_with_token,
    start_api_server,
    stop_api_server,
)

#: The client under test is this checkout's, even when the shared virtualenv has it
#: installed (editable) from another one; the airlock-mcp subprocesses get it too.
CLIENT_SRC = str(Path(__file__).resolve().parents[2] / "clients" / "python" / "src")
if CLIENT_SRC not in sys.path:
    sys.path.insert(0, CLIENT_SRC)


@dataclass
class Live:
    url: str
    operator_token: str

    def decide(
        self,
        *,
        run: str | None = None,
        action: str | None = None,
        plan: str | None = None,
        agent: str | None = None,
        decision: str = "approve",
        comment: str = "",
        timeout: float = 30,
    ) -> None:
        """Decide the pending approval of a run, an action, a plan or (`agent`) an action
        of that agent, once it exists."""

        def wanted(item: dict[str, Any]) -> bool:
            return bool(
                (run and item["subject"] == "run" and item["run"] == run)
                or (action and item.get("action") == action)
                or (plan and item.get("plan") == plan)
                or (agent and item["subject"] == "action" and item["agent"] == agent)
            )

        what = f"run={run} action={action} plan={plan} agent={agent}"
        approval = self._pending_approval(wanted, what, timeout)
        response = httpx.post(
            f"{self.url}/api/v1/approvals/{approval}/decision",
            headers={"Authorization": f"Bearer {self.operator_token}"},
            json={"decision": decision, "comment": comment},
            timeout=10,
        )
        assert response.status_code == 200, response.text

    def _pending_approval(
        self, wanted: Callable[[dict[str, Any]], bool], what: str, timeout: float
    ) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            page = httpx.get(
                f"{self.url}/api/v1/approvals?status=pending&limit=200",
                headers={"Authorization": f"Bearer {self.operator_token}"},
                timeout=10,
            ).json()
            for item in page["items"]:
                if wanted(item):
                    return str(item["id"])
            time.sleep(0.05)
        raise AssertionError(f"no pending approval for {what}")

    def approve_next_run_of(self, agent_token: str) -> threading.Thread:
        """In the background: approve the agent's next pending run (the client's
        start_run blocks on the long-poll meanwhile)."""

        def approve() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                runs = httpx.get(
                    f"{self.url}/api/v1/runs?status=pending_approval",
                    headers={"Authorization": f"Bearer {agent_token}"},
                    timeout=10,
                ).json()["items"]
                if runs:
                    self.decide(run=runs[0]["id"], comment="go ahead")
                    return
                time.sleep(0.05)

        thread = threading.Thread(target=approve, daemon=True)
        thread.start()
        return thread


@pytest.fixture
def _worker_booting(rq_worker: Any) -> None:
    """An RQ worker started before the server (set up first by `live`): both import
    Django, about 1.5 s each, side by side instead of one after the other."""
    rq_worker()


@pytest.fixture
def live(_worker_booting: None, live_without_worker: Live) -> Live:
    return live_without_worker


@pytest.fixture
def live_without_worker(rq_worker: Any, transactional_db: Any, prod_alerts: Any) -> Iterator[Live]:
    """The live server with no RQ worker yet: approved writes stay queued until the
    test starts one (`rq_worker()`)."""
    # rq_worker points settings.REDIS_URL at a private redis-server, so the web server,
    # the worker and this process share it.
    ensure_api_kinds()
    operator = make_person_with_token("ana", "operators")
    server = start_api_server()
    try:
        yield Live(url=server.url, operator_token=operator.token)
    finally:
        stop_api_server(server)


@pytest.fixture
def agent_tokens(live: Live) -> dict[str, str]:
    return {
        name: make_agent_with_token(name).token
        for name in ("alerts-bot-a", "alerts-bot-b", "dns-bot")
    }


POLICY = "notification-policy/prod-alerts"
POLICY_WRITE_SET = [(POLICY, ["update"])]
