"""Database connections of the default deployment: web processes pool (bounded per process,
sized from WEB_CONCURRENCY), workers keep one connection, `manage.py check` warns when the
web pools cannot fit in the server's max_connections (airlock.W011), and a request that
waits past the pool timeout is a clear retryable 503."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from approvals.services.tokens import LOOKUP_PREFIX_LENGTH
from tests.conftest import ROOT, free_port, subprocess_env, test_database_url
from tests.deployload import (
    default_environment,
    script_json,
    seed_poll_target,
    start_procfile_web,
)

DATABASE_SETTINGS = (
    "from django.conf import settings as s; d = s.DATABASES['default']; "
    "print(json.dumps({'options': d.get('OPTIONS', {}), 'max_age': d['CONN_MAX_AGE']}))"
)


def _database_settings(*, asgi: bool, **env: str) -> dict[str, Any]:
    loader = "import console.asgi" if asgi else "import django; django.setup()"
    environment = default_environment(DATABASE_URL=test_database_url(), **env)
    return script_json(f"import json; {loader}; {DATABASE_SETTINGS}", environment=environment)


@pytest.mark.django_db
def test_a_web_process_pools_a_bounded_number_of_connections_sized_from_web_concurrency() -> None:
    web = _database_settings(asgi=True)
    assert web["max_age"] == 0
    assert web["options"]["pool"] == {"min_size": 2, "max_size": 20, "timeout": 10}
    busier = _database_settings(asgi=True, WEB_CONCURRENCY="8")
    assert busier["options"]["pool"]["max_size"] == 5  # the same ~40 shared by 8 processes
    assert _database_settings(asgi=True, WEB_CONCURRENCY="64")["options"]["pool"]["max_size"] == 4


@pytest.mark.django_db
def test_a_worker_process_keeps_one_persistent_connection_unless_told_to_pool() -> None:
    worker = _database_settings(asgi=False)
    assert worker["max_age"] == 60
    assert "pool" not in worker["options"]
    forced = _database_settings(asgi=False, AIRLOCK_DB_POOL="true", AIRLOCK_DB_POOL_MAX="3")
    assert forced["options"]["pool"]["max_size"] == 3
    assert "pool" not in _database_settings(asgi=True, AIRLOCK_DB_POOL="false")["options"]


def _check(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _max_connections() -> int:
    with psycopg.connect(test_database_url()) as conn:
        row = conn.execute("SHOW max_connections").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.django_db
def test_check_warns_when_web_processes_times_pool_max_exceed_max_connections() -> None:
    processes = _max_connections() // 20 + 1  # x 20 each: just over the server's limit
    result = _check(WEB_CONCURRENCY=str(processes), AIRLOCK_DB_POOL_MAX="20")
    assert result.returncode == 0, result.stderr  # a warning, not an error
    assert "airlock.W011" in result.stderr + result.stdout
    assert f"{processes} web processes" in result.stderr + result.stdout


@pytest.mark.django_db
def test_check_counts_the_short_polls_own_connections_beside_the_pool() -> None:
    processes = _max_connections() // 25  # x (20 + 1) each fits; x (20 + 20) does not
    fits = _check(
        WEB_CONCURRENCY=str(processes), AIRLOCK_DB_POOL_MAX="20", AIRLOCK_FAST_POLL_CONNECTIONS="1"
    )
    assert "airlock.W011" not in fits.stderr + fits.stdout
    result = _check(
        WEB_CONCURRENCY=str(processes),
        AIRLOCK_DB_POOL_MAX="20",
        AIRLOCK_FAST_POLL_CONNECTIONS="20",
    )
    assert "airlock.W011" in result.stderr + result.stdout
    assert "AIRLOCK_FAST_POLL_CONNECTIONS" in result.stderr + result.stdout


@pytest.mark.django_db
def test_check_is_quiet_when_the_pools_fit() -> None:
    result = _check(WEB_CONCURRENCY="2")
    assert result.returncode == 0, result.stderr
    assert "airlock.W011" not in result.stderr + result.stdout


def test_check_warns_when_the_web_processes_are_told_not_to_pool() -> None:
    result = _check(AIRLOCK_DB_POOL="false")
    assert "airlock.W011" in result.stderr + result.stdout
    assert "AIRLOCK_DB_POOL=false" in result.stderr + result.stdout


def test_check_passes_quietly_when_the_database_cannot_be_reached() -> None:
    closed = f"postgres://postgres@127.0.0.1:{free_port()}/airlock"
    result = _check(DATABASE_URL=closed, WEB_CONCURRENCY="500")
    assert result.returncode == 0, result.stderr
    assert "airlock.W011" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_request_that_waits_past_the_pool_timeout_gets_a_retryable_503(
    tmp_path: Path,
) -> None:
    """One pooled connection, held by a poll whose token update waits on a row lock the
    test holds: the next request waits the pool timeout, then answers 503 problem+json with
    Retry-After; the held request completes once the lock is released."""
    from django.conf import settings

    target = seed_poll_target(2)
    env = default_environment(
        DATABASE_URL=test_database_url(),
        REDIS_URL=settings.REDIS_URL,
        AIRLOCK_DATA_DIR=str(tmp_path / "data"),
        WEB_CONCURRENCY="1",
        AIRLOCK_DB_POOL_MAX="1",
        AIRLOCK_DB_POOL_TIMEOUT="1",
    )
    web = start_procfile_web(env, free_port(), tmp_path / "web.log")
    held: dict[str, httpx.Response] = {}
    try:
        with psycopg.connect(test_database_url()) as lock:
            lock.execute(
                "SELECT 1 FROM approvals_agenttoken WHERE prefix = %s FOR UPDATE",
                [target.tokens[0][:LOOKUP_PREFIX_LENGTH]],
            )
            first = threading.Thread(
                target=lambda: held.update(
                    response=httpx.get(
                        f"{web.url}{target.path}",
                        headers={"Authorization": f"Bearer {target.tokens[0]}"},
                        timeout=30,
                    )
                )
            )
            first.start()
            _wait_until_blocked_on_a_lock()
            second = httpx.get(
                f"{web.url}{target.path}",
                headers={"Authorization": f"Bearer {target.tokens[1]}"},
                timeout=30,
            )
            lock.rollback()
        first.join(timeout=30)
    finally:
        web.stop()
    assert second.status_code == 503, second.text
    assert second.headers["Content-Type"] == "application/problem+json"
    assert second.headers["Retry-After"] == "1"
    problem = second.json()
    assert problem["code"] == "unavailable" and problem["retryable"] is True
    assert "connection limit" in problem["detail"]
    assert held["response"].status_code == 200, held["response"].text


def _wait_until_blocked_on_a_lock() -> None:
    # Its own session: pg_stat_activity is a snapshot for the length of a transaction.
    deadline = time.monotonic() + 20
    with psycopg.connect(test_database_url(), autocommit=True) as watcher:
        while time.monotonic() < deadline:
            row = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE%%agenttoken%%'"
            ).fetchone()
            if row and row[0]:
                return
            time.sleep(0.05)
    raise AssertionError("the first poll never waited on the token row")
