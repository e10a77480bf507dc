"""Shared test setup: real PostgreSQL, real Redis, real processes.

Each area keeps its own fixtures in tests/fixtures/<area>.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.management.color import Style
from django.db import connection
from django.db.backends.base.operations import BaseDatabaseOperations
from django.db.backends.postgresql.operations import DatabaseOperations as PostgresOperations
from django.db.backends.signals import connection_created

pytest_plugins = [
    "tests.fixtures.core",
    "tests.fixtures.api",
    "tests.fixtures.engine",
    "tests.fixtures.console",
    "tests.fixtures.plans",
    "tests.fixtures.dav",
    "tests.fixtures.sshd",
    "tests.fixtures.last_read",
]

ROOT = Path(__file__).resolve().parent.parent


def _allow_audit_maintenance(sender: Any, connection: Any, **kwargs: Any) -> None:
    # Django's test teardown empties every table (_flush_by_delete); the append-only
    # triggers allow that only when this session setting is on. Tests of the trigger
    # turn it off again with SET LOCAL.
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET airlock.audit_maintenance = 'on'")


connection_created.connect(_allow_audit_maintenance)


# What post_migrate writes back after every flush, unchanged: left in place.
_KEPT_BY_FLUSH = frozenset({"django_content_type", "auth_permission"})


def _flush_by_delete(
    self: BaseDatabaseOperations,
    style: Style,
    tables: Sequence[str],
    *,
    reset_sequences: bool = False,
    allow_cascade: bool = False,
) -> list[str]:
    """The flush after each transactional test: DELETE instead of TRUNCATE. A TRUNCATE of
    the 35 tables gives each table and index a new file, 0.25-0.3 s a time here, where
    deleting the few rows a test leaves takes about 0.01 s. Same outcome: every row gone in
    one transaction (Django's foreign keys are checked at its commit, deferred), sequences
    not reset, and the audit's append-only triggers decide as they do for TRUNCATE (the
    maintenance setting above lets both pass) — except the content types and permissions,
    which the flush's post_migrate would write back as they were (kept: 0.05 s less)."""
    if reset_sequences or allow_cascade or not tables:
        return _truncate_flush(
            self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )
    names = (
        style.SQL_FIELD(self.quote_name(table)) for table in tables if table not in _KEPT_BY_FLUSH
    )
    return [f"DELETE FROM {name}" for name in names]  # noqa: S608 - quoted table names


_truncate_flush = PostgresOperations.sql_flush
PostgresOperations.sql_flush = _flush_by_delete  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    if settings.DATABASES["default"]["ENGINE"] != settings.POSTGRES_ENGINE:
        raise pytest.UsageError(
            "The suite runs against real PostgreSQL: set DATABASE_URL (make test does)."
        )


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client
    client.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A redis-server of the test's own on a free port, so a test may FLUSHALL,
    stop or restart it without touching anything else."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server") or str(Path(sys.executable).parent / "redis-server")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=0.2).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def test_database_url() -> str:
    """The URL of the database the tests run against (test_<name>), for subprocesses."""
    db = connection.settings_dict
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    user = db.get("USER") or "postgres"
    return f"postgres://{user}@{host}:{port}/{db['NAME']}"


test_database_url.__test__ = False  # type: ignore[attr-defined]


def subprocess_env(**overrides: str) -> dict[str, str]:
    """Environment for a Django subprocess (worker, server) on the test database."""
    env = dict(os.environ)
    env["DATABASE_URL"] = test_database_url()
    env["REDIS_URL"] = settings.REDIS_URL
    env["DJANGO_SETTINGS_MODULE"] = "console.settings"
    env["PYTHONPATH"] = str(ROOT)
    env.update(overrides)
    return env


def start_make_run(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """scripts/run.py as `make run` starts it, in its own session (stop it with killpg)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "run.py")],
        cwd=ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(autouse=True)
def _reference_data(request: pytest.FixtureRequest) -> None:
    """Conflict classes, role groups and the audit head exist in every test that has a db."""
    marker_names = {m.name for m in request.node.iter_markers()}
    fixture_names = set(request.fixturenames)
    if "django_db" in marker_names or fixture_names & {"db", "transactional_db"}:
        request.getfixturevalue("transactional_db" if _wants_transactional(request) else "db")
        from console.reference import ensure_reference_data

        ensure_reference_data()
        _audit_numbers_from_one()


def _audit_numbers_from_one() -> None:
    """The audit's seq numbers start at 1 in every test, as in a new database: the flush
    between tests deletes the events but leaves their sequence where it was (a sequence is
    not transactional, so neither do the `db` tests' rollbacks)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT setval('audit_auditevent_seq', 1, false) "
            "WHERE NOT EXISTS (SELECT FROM audit_auditevent)"
        )


def _wants_transactional(request: pytest.FixtureRequest) -> bool:
    if "transactional_db" in request.fixturenames:
        return True
    marker = request.node.get_closest_marker("django_db")
    return bool(marker and (marker.kwargs.get("transaction") or (marker.args and marker.args[0])))
