"""A PostgreSQL restart costs nothing once the database answers again.

A private PostgreSQL (max_connections 100, the default) serves the Procfile's processes: `web`,
a real `worker` and `cron` (default settings). While `wrk` polls and an agent sends writes in
its approved run (retrying a 503 with the same Idempotency-Key, as a client must), PostgreSQL
is stopped (fast shutdown: every session cut) and started again. From the moment it answers
again, no poll is answered >= 500, and every write is applied exactly once (a job that met
the outage fails in RQ; the cron process's reconciler sends it again within seconds).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import free_port
from tests.deployload import (
    WrkResult,
    default_environment,
    run_wrk,
    seed_in_subprocess,
    start_procfile,
    start_procfile_web,
    summary,
)
from tests.privatepg import PrivatePostgres

pytestmark = [pytest.mark.slow]

CLIENTS = 64
WRITES = 24
LOAD_SECONDS = 14
RESTART_AFTER = 4.0
# Down long enough that the polls in flight when every session was cut (they answer 503,
# retryable, during the outage) are answered before it is back, even on a loaded machine.
DOWNTIME = 2.0
RETRYABLE = {409, 503}  # idempotency key in flight / database unavailable: send it again


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres(max_connections=100)
    try:
        server.start()
        yield server
    finally:
        server.destroy()


class Writer(threading.Thread):
    """Creates dns-record/load-w{i} one after another through the API, each with its own
    Idempotency-Key, resending the same request on a retryable answer or a lost one."""

    def __init__(self, base_url: str, run_token: str, count: int) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.run_token = run_token
        self.count = count
        self.accepted: dict[int, str] = {}  # i -> action id
        self.answers: Counter[str] = Counter()
        self.unexpected: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            for i in range(self.count):
                self._send(client, i)
                time.sleep(0.15)

    def _send(self, client: httpx.Client, i: int) -> None:
        headers = {
            "Authorization": f"Bearer {self.run_token}",
            "If-None-Match": "*",
            "Idempotency-Key": f"restart-write-{i}",
        }
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                response = client.put(
                    f"{self.base_url}/api/v1/resources/dns-record/load-w{i}",
                    json={"n": i},
                    headers=headers,
                )
            except httpx.HTTPError as exc:
                self.answers[type(exc).__name__] += 1
                time.sleep(0.2)
                continue
            self.answers[str(response.status_code)] += 1
            if response.status_code == 202:
                self.accepted[i] = response.json()["id"]
                return
            if response.status_code not in RETRYABLE:
                self.unexpected.append(f"write {i}: {response.status_code} {response.text}")
                return
            time.sleep(0.2)
        self.unexpected.append(f"write {i}: never accepted")


def _outcome(url: str) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        actions = conn.execute(
            "SELECT name, status FROM approvals_action WHERE name LIKE 'load-w%'"
        ).fetchall()
        operations = conn.execute(
            "SELECT a.name, o.status FROM approvals_operation o "
            "JOIN approvals_action a ON a.id = o.action_id WHERE a.name LIKE 'load-w%'"
        ).fetchall()
        versions = conn.execute(
            "SELECT r.name, count(v.id), max(r.version) FROM ownership_resource r "
            "JOIN ownership_resourceversion v ON v.resource_id = r.id "
            "WHERE r.name LIKE 'load-w%' GROUP BY r.name"
        ).fetchall()
    return {"actions": actions, "operations": operations, "versions": versions}


def _all_settled(url: str) -> bool:
    statuses = {status for _, status in _outcome(url)["actions"]}
    return bool(statuses) and statuses <= {"applied", "failed", "conflict", "cancelled"}


def test_a_postgresql_restart_under_load_costs_nothing_once_it_answers_again(
    tmp_path: Path, private_postgres: PrivatePostgres, private_redis: Any
) -> None:
    database_url = private_postgres.create_database("airlock")
    env = default_environment(
        DATABASE_URL=database_url,
        REDIS_URL=private_redis.url,
        AIRLOCK_DATA_DIR=str(tmp_path / "data"),
    )
    target = seed_in_subprocess(env, 8, migrate=True)
    web = start_procfile_web(env, free_port(), tmp_path / "web.log")
    worker = start_procfile("worker", env, tmp_path / "worker.log")
    cron = start_procfile("cron", env, tmp_path / "cron.log")
    results: list[WrkResult] = []
    try:
        load = threading.Thread(
            target=lambda: results.append(
                run_wrk(
                    f"{web.url}{target.path}",
                    target.tokens,
                    clients=CLIENTS,
                    seconds=LOAD_SECONDS,
                )
            ),
            daemon=True,
        )
        load.start()
        writer = Writer(web.url, target.run_token, WRITES)
        time.sleep(RESTART_AFTER - 1.5)
        writer.start()  # writes before, during and after the restart
        time.sleep(1.5)
        answering_again = private_postgres.restart(downtime=DOWNTIME)
        load.join(timeout=LOAD_SECONDS + 60)
        writer.join(timeout=120)
        deadline = time.monotonic() + 60
        while not _all_settled(database_url) and time.monotonic() < deadline:
            time.sleep(0.2)
        outcome = _outcome(database_url)
    finally:
        for process in (web, worker, cron):
            process.stop()
    [result] = results
    logs = "".join(f"\n--- {p.name}\n{p.output()[-3000:]}" for p in (web, worker, cron))
    after = result.failures_after(answering_again)
    print(
        f"{CLIENTS} clients: {summary(result)}; "
        f"answers in the first second after PostgreSQL answered again: "
        f"{result.answered_between(answering_again, answering_again + 1)}, "
        f"the first {result.first_answer_after(answering_again) - answering_again:.1f} s "
        "after it; "
        f">= 500 after it: {len(after)}; writes: {dict(writer.answers)}"
    )
    # Polls: whatever failed while PostgreSQL was down (the polls in flight when it cut
    # every session), nothing fails from the moment it answers again to the end of the
    # load, first second included; and the load really went on after it (not vacuous).
    assert after == [], f"{len(after)} answers >= 500 after PostgreSQL answered again{logs}"
    assert not any(result.socket_errors.values()), summary(result)
    assert result.answered_between(answering_again, answering_again + 60) > CLIENTS
    # Writes: every one accepted once and applied once; none lost, none doubled.
    assert writer.unexpected == [], writer.unexpected
    assert sorted(writer.accepted) == list(range(WRITES))
    names = [name for name, _ in outcome["actions"]]
    assert sorted(names) == sorted(f"load-w{i}" for i in range(WRITES)), outcome["actions"]
    assert {status for _, status in outcome["actions"]} == {"applied"}, f"{outcome}{logs}"
    done = Counter(name for name, status in outcome["operations"] if status == "done")
    assert done == Counter({f"load-w{i}": 1 for i in range(WRITES)}), outcome["operations"]
    assert sorted(outcome["versions"]) == sorted((f"load-w{i}", 1, 1) for i in range(WRITES))
