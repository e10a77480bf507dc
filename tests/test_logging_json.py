"""The web process as the Procfile starts it (defaults: not DEBUG) logs JSON lines, each
carrying the request id and the principal who called (kind and name, never the token)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from tests.conftest import free_port, test_database_url
from tests.deployload import default_environment, start_procfile_web
from tests.fixtures.api import make_active_run, make_agent_with_token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def json_lines(text: str) -> list[dict[str, object]]:
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def test_the_web_process_logs_json_with_the_request_id_and_principal(tmp_path: Path) -> None:
    agent = make_agent_with_token("logbot")
    run = make_active_run(agent.agent)
    env = default_environment(DATABASE_URL=test_database_url(), REDIS_URL=settings.REDIS_URL)
    env["AIRLOCK_DATA_DIR"] = str(tmp_path / "data")
    web = start_procfile_web(env, free_port(), tmp_path / "web.log")
    try:
        answer = httpx.get(
            f"{web.url}/api/v1/resources/notification-policy/no-such-thing",
            headers={"Authorization": f"Bearer {run.token}", "X-Request-Id": "req-logs-1"},
        )
        assert answer.status_code == 404
    finally:
        web.stop()
    output = web.output()
    lines = json_lines(output)
    assert lines, output
    mine = [line for line in lines if line.get("request_id") == "req-logs-1"]
    assert mine, output
    line = mine[0]
    assert line["logger"] == "django.request" and line["level"] == "WARNING"
    assert str(line["principal"]).startswith("run:")
    assert {"time", "message"} <= set(line)
    assert run.token not in output and agent.token not in output
