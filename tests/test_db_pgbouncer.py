"""A deployment behind PgBouncer says so (AIRLOCK_PGBOUNCER): in transaction mode no
connection prepares a statement — neither Django's nor the poll front's — unless
AIRLOCK_DB_PREPARE_THRESHOLD turns them back on, and `check --deploy` warns when the
DATABASE_URL looks like a bouncer's (airlock.W020) or when transaction pooling meets
prepared statements (airlock.W021). Real PostgreSQL: what the server's
pg_prepared_statements shows for the session, not what a setting claims."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psycopg
import pytest
from django.conf import settings

from tests.conftest import ROOT, free_port, subprocess_env, test_database_url
from tests.deployload import (
    PollTarget,
    default_environment,
    script_json,
    seed_poll_target,
    start_procfile_web,
)
from tests.test_settings_deploy import PRODUCTION, check_deploy

# A web-like process (pooled, as console.asgi loads it): the same SELECT ten times on
# Django's connection and twice on the poll front's, then what each session prepared.
_PREPARED = """
import asyncio, json
import console.asgi  # a web process: its connections are pooled
from django.conf import settings
from django.db import connection
from approvals.api.fastpoll_sql import Connections, connection_kwargs

COUNT = "SELECT count(*) FROM pg_prepared_statements WHERE NOT from_sql"
with connection.cursor() as cursor:
    for _ in range(10):
        cursor.execute("SELECT %s::int + 1", [1])
    # (on the psycopg connection itself: the count is not to be prepared)
    django_prepared = connection.connection.execute(COUNT, prepare=False).fetchone()[0]
connection.close()


async def front():
    kwargs = connection_kwargs()
    pool = Connections(kwargs, 1)
    await pool.rows("SELECT %s::int + 1", (1,))
    await pool.rows("SELECT %s::int + 1", (1,))
    rows = await pool.rows(COUNT, ())
    timezone = pool.idle[0].connection.info.parameter_status("TimeZone")
    await pool.idle[0].connection.close()
    return rows[0][0], timezone, "options" in kwargs


front_prepared, front_timezone, startup_options = asyncio.run(front())
print(json.dumps({
    "threshold": settings.DATABASES["default"]["OPTIONS"]["prepare_threshold"],
    "django_prepared": django_prepared,
    "front_prepared": front_prepared,
    "front_timezone": front_timezone,
    "startup_options": startup_options,
}))
"""


def _prepared(**env: str) -> dict[str, object]:
    environment = default_environment(DATABASE_URL=test_database_url(), **env)
    return script_json(_PREPARED, environment=environment)


@pytest.mark.django_db
def test_by_default_both_paths_prepare_their_statements() -> None:
    seen = _prepared()
    assert seen["threshold"] == 5
    # Django's SELECT, prepared after 5 runs; the front's SELECT and COUNT, at once.
    assert seen["django_prepared"] == 1, seen
    assert seen["front_prepared"] == 2, seen
    assert seen["front_timezone"] == "UTC" and seen["startup_options"], seen


@pytest.mark.django_db
def test_behind_transaction_pooling_no_session_prepares_a_statement() -> None:
    seen = _prepared(AIRLOCK_PGBOUNCER="transaction")
    assert seen["threshold"] is None
    assert seen["django_prepared"] == 0, seen
    assert seen["front_prepared"] == 0, seen
    # No `options` startup parameter (PgBouncer before 1.20 refuses the connection), and
    # still UTC: a SET, which PgBouncer carries to every server session it lends.
    assert not seen["startup_options"] and seen["front_timezone"] == "UTC", seen


@pytest.mark.django_db
def test_the_prepare_threshold_is_a_setting_of_its_own() -> None:
    assert _prepared(AIRLOCK_DB_PREPARE_THRESHOLD="off")["django_prepared"] == 0
    back_on = _prepared(AIRLOCK_PGBOUNCER="transaction", AIRLOCK_DB_PREPARE_THRESHOLD="5")
    assert back_on["threshold"] == 5 and back_on["django_prepared"] == 1, back_on


def test_an_unknown_pooling_mode_is_refused_at_startup() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env=subprocess_env(AIRLOCK_PGBOUNCER="statement-ish"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "AIRLOCK_PGBOUNCER must be session or transaction" in done.stderr


def _deploy(tmp_path: Path, **env: str) -> str:
    environment = subprocess_env(**PRODUCTION, SECRET_KEY=secrets.token_urlsafe(60), **env)
    environment["AIRLOCK_DATA_DIR"] = str(tmp_path)
    result = check_deploy(environment)
    return result.stdout + result.stderr


def test_check_deploy_warns_when_the_database_url_looks_like_pgbouncer(tmp_path: Path) -> None:
    bouncer = "postgres://airlock@127.0.0.1:6432/airlock"
    assert "airlock.W020" in _deploy(tmp_path, DATABASE_URL=bouncer)
    named = "postgres://airlock@pgbouncer.internal:5432/airlock"
    assert "airlock.W020" in _deploy(tmp_path, DATABASE_URL=named)
    declared = _deploy(tmp_path, DATABASE_URL=bouncer, AIRLOCK_PGBOUNCER="transaction")
    assert "airlock.W020" not in declared and "airlock.W021" not in declared, declared
    assert "no issues" in declared, declared


def test_check_deploy_warns_when_transaction_pooling_meets_prepared_statements(
    tmp_path: Path,
) -> None:
    output = _deploy(
        tmp_path,
        DATABASE_URL="postgres://airlock@127.0.0.1:6432/airlock",
        AIRLOCK_PGBOUNCER="transaction",
        AIRLOCK_DB_PREPARE_THRESHOLD="5",
    )
    assert "airlock.W021" in output
    assert "max_prepared_statements" in output


@pytest.mark.django_db
def test_check_deploy_is_quiet_for_a_direct_postgresql_url(tmp_path: Path) -> None:
    output = _deploy(tmp_path)  # the test database, port 5432
    assert "airlock.W020" not in output and "airlock.W021" not in output, output


@pytest.mark.django_db
def test_behind_a_bouncer_the_pools_are_not_weighed_against_the_servers_max_connections() -> None:
    def check(**env: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", "check"],
            cwd=ROOT,
            env=subprocess_env(WEB_CONCURRENCY="500", **env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.stdout + done.stderr

    assert "airlock.W011" in check()  # 500 x the pool: past any default max_connections
    # The bouncer's max_client_conn takes the pools, its default_pool_size bounds the server.
    assert "airlock.W011" not in check(AIRLOCK_PGBOUNCER="transaction")


class PgBouncer:
    """PgBouncer of the test's own in TRANSACTION mode in front of the test server, with
    two server sessions per database/user: consecutive transactions of one client land
    on either, and the sessions are shared by every client."""

    def __init__(self) -> None:
        # Not under pytest's folder: root's, which the bouncer's own user cannot enter.
        folder = Path(tempfile.mkdtemp(prefix="airlock-bouncer-"))
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(binary).exists():
            raise AssertionError("pgbouncer is not installed (apt-get install pgbouncer)")
        self.port = free_port()
        self.folder = folder
        prefix: list[str] = []
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            prefix = ["runuser", "-u", "postgres", "--"]
            user = pwd.getpwnam("postgres")
            os.chown(folder, user.pw_uid, user.pw_gid)
        (folder / "users.txt").write_text('"postgres" ""\n')
        (folder / "pgbouncer.ini").write_text(
            "[databases]\n* = host=127.0.0.1 port=5432\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
            "pool_mode = transaction\ndefault_pool_size = 2\nmax_client_conn = 200\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {folder / 'pgbouncer.log'}\npidfile = {folder / 'pgbouncer.pid'}\n"
        )
        self.process = subprocess.Popen(
            [*prefix, binary, str(folder / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with psycopg.connect(self.url("postgres"), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(self.log()) from None
                time.sleep(0.1)

    def url(self, database: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def log(self) -> str:
        path = self.folder / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=15)
        shutil.rmtree(self.folder, ignore_errors=True)


def _poll_both_paths(web_url: str, target: PollTarget, rounds: int) -> Counter[tuple[str, int]]:
    """`rounds` of a poll through the poll front (run token) and one through Django (agent
    token), from 8 clients at once: their (path, status) counts."""
    statuses: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=web_url, timeout=30) as http:
            for _ in range(rounds):
                for name, token in (("front", target.run_token), ("django", target.tokens[0])):
                    answer = http.get(target.path, headers={"Authorization": f"Bearer {token}"})
                    with lock:
                        statuses[(name, answer.status_code)] += 1

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return statuses


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_web_process_serves_through_pgbouncer_in_transaction_mode(tmp_path: Path) -> None:
    """The Procfile's `web` line with DATABASE_URL at a transaction-mode PgBouncer: with
    AIRLOCK_PGBOUNCER=transaction every poll of both paths is a 200; without it (prepared
    statements on) the same polls fail, which is why the setting exists."""
    target = seed_poll_target(1)
    bouncer = PgBouncer()
    database = str(settings.DATABASES["default"]["NAME"])
    try:

        def serve(name: str, **extra: str) -> Counter[tuple[str, int]]:
            env = default_environment(
                DATABASE_URL=bouncer.url(database),
                REDIS_URL=settings.REDIS_URL,
                WEB_CONCURRENCY="1",
                AIRLOCK_DATA_DIR=str(tmp_path / "data"),
                **extra,
            )
            web = start_procfile_web(env, free_port(), tmp_path / f"{name}.log")
            try:
                return _poll_both_paths(web.url, target, rounds=15)
            finally:
                web.stop()

        declared = serve("declared", AIRLOCK_PGBOUNCER="transaction")
        undeclared = serve("undeclared")
    finally:
        bouncer.stop()
    assert declared == Counter({("front", 200): 120, ("django", 200): 120}), (
        f"{declared}\n{(tmp_path / 'declared.log').read_text()[-3000:]}"
    )
    print(f"declared: {declared}; undeclared: {undeclared}")
    assert any(status >= 500 for _, status in undeclared), undeclared
