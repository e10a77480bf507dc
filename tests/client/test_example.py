"""examples/agent_loop.py runs as documented against a live Airlock: a person approves its
run and its change; it creates the policy, patches it, and a second run has nothing to do."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ownership.models import Resource as ResourceRow
from tests.client.conftest import Live
from tests.fixtures.api import make_agent_with_token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


def approve_the_agents_change(live: Live, agent: str) -> None:
    live.decide(agent=agent, comment="fine", timeout=60)


def run_example(live: Live, token: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AIRLOCK_URL": live.url, "AIRLOCK_AGENT_TOKEN": token}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_loop.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_the_example_agent_loop_applies_its_change_once_approved(live: Live) -> None:
    token = make_agent_with_token("example-bot").token
    live.approve_next_run_of(token)
    approver = threading.Thread(target=approve_the_agents_change, args=(live, "example-bot"))
    approver.start()
    first = run_example(live, token)
    approver.join(timeout=60)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Applied: notification-policy/example-alerts is now at" in first.stdout
    row = ResourceRow.objects.get(kind_id="notification-policy", name="example-alerts")
    assert row.document["destinations"] == ["oncall@example.test", "backup@example.test"]

    live.approve_next_run_of(token)
    second = run_example(live, token)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "nothing to do" in second.stdout
