"""The PostgreSQL rows adapter (engine/targets/postgres.py) against real tables.

The tables live in a scratch database of their own (the test database's name + `_rows`),
created here and written through the adapter's own connections — never through Django's
test transaction, which the adapter could not see.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from engine.targets import pg_pool
from engine.targets.base import (
    ABSENT,
    Applied,
    Conflict,
    NotApplied,
    Outcome,
    TargetConfigError,
    TargetError,
    settle_by_reading,
)
from engine.targets.postgres import PostgresSettings, PostgresTarget

ENV = "AIRLOCK_TEST_ROWS_DB"
PASSWORD = "Pg-Sekr1t-Pass"


def _server_url(dbname: str) -> str:
    base = urlsplit(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/airlock"))
    return urlunsplit(base._replace(path=f"/{dbname}"))


@pytest.fixture(scope="module")
def rows_db() -> Iterator[str]:
    base = urlsplit(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/airlock"))
    dbname = f"{base.path.lstrip('/') or 'airlock'}_rows"
    with psycopg.connect(_server_url("postgres"), autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    yield _server_url(dbname)
    with psycopg.connect(_server_url("postgres"), autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )


@pytest.fixture
def table(rows_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(rows_db, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (name text PRIMARY KEY, doc jsonb NOT NULL, "
                "version bigint NOT NULL, fence bigint)"
            ).format(sql.Identifier(name))
        )
    monkeypatch.setenv(ENV, rows_db)
    yield name


def _target(table: str, **extra: Any) -> PostgresTarget:
    settings: dict[str, Any] = {
        "credentials_env": ENV,
        "table": table,
        "key_column": "name",
        "document_column": "doc",
        "version_column": "version",
        "fence_column": "fence",
    }
    settings.update(extra)
    return PostgresTarget(
        PostgresSettings.from_settings({k: v for k, v in settings.items() if v is not None})
    )


def _key() -> str:
    return f"airlock-action-{uuid.uuid4()}"


def _seed(target: PostgresTarget, name: str, document: Any) -> str:
    created = target.create(name, document, fence=1, idempotency_key=_key())
    assert created.outcome is Outcome.APPLIED, created
    assert created.version is not None
    return created.version


def test_two_writers_from_the_same_version_one_applies_the_other_is_stale(table: str) -> None:
    target = _target(table)
    v1 = _seed(target, "acme", {"limit": 1})
    first = target.write("acme", {"limit": 2}, expected_version=v1, fence=2, idempotency_key=_key())
    second = target.write(
        "acme", {"limit": 3}, expected_version=v1, fence=3, idempotency_key=_key()
    )
    assert first.outcome is Outcome.APPLIED and first.version == "2"
    assert second.outcome is Outcome.STALE
    assert second.current is not None
    assert (second.current.document, second.current.version) == ({"limit": 2}, "2")
    # Nothing lost: the row holds the first write, and the second can retry on it.
    assert target.read("acme").document == {"limit": 2}
    retried = target.write(
        "acme",
        {"limit": 3},
        expected_version=second.current.version,
        fence=3,
        idempotency_key=_key(),
    )
    assert retried.outcome is Outcome.APPLIED and target.read("acme").document == {"limit": 3}


def test_concurrent_writers_from_the_same_version_exactly_one_applies(table: str) -> None:
    target = _target(table)
    v1 = _seed(target, "acme", {"n": 0})
    start = threading.Barrier(8)
    results: list[Any] = []

    def writer(i: int) -> None:
        start.wait()
        results.append(
            target.write(
                "acme", {"n": i}, expected_version=v1, fence=10 + i, idempotency_key=_key()
            )
        )

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    applied = [r for r in results if r.outcome is Outcome.APPLIED]
    assert len(applied) == 1, results
    assert all(r.outcome in (Outcome.STALE, Outcome.FENCED) for r in results if not r.applied)
    assert target.read("acme").version == applied[0].version == "2"


def test_a_stale_fence_is_refused_even_on_the_current_version(table: str) -> None:
    target = _target(table)
    v1 = _seed(target, "acme", {"n": 1})
    new = target.write("acme", {"n": 2}, expected_version=v1, fence=7, idempotency_key=_key())
    assert new.applied and new.version is not None
    zombie = target.write(
        "acme", {"n": 9}, expected_version=new.version, fence=5, idempotency_key=_key()
    )
    assert zombie.outcome is Outcome.FENCED
    assert target.read("acme").document == {"n": 2}
    assert target.write(
        "acme", {"n": 3}, expected_version=new.version, fence=8, idempotency_key=_key()
    ).applied
    assert target.capabilities.holds_fence and not target.capabilities.takes_idempotency_key
    assert not _target(table, fence_column=None).capabilities.holds_fence


def test_create_if_absent_race_one_wins_the_other_sees_it(table: str) -> None:
    target = _target(table)
    start = threading.Barrier(6)
    results: list[Any] = []

    def creator(i: int) -> None:
        start.wait()
        results.append(target.create("new", {"by": i}, fence=1, idempotency_key=_key()))

    threads = [threading.Thread(target=creator, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [r for r in results if r.applied]
    assert len(winners) == 1
    held = target.read("new")
    for loser in (r for r in results if not r.applied):
        assert loser.outcome is Outcome.STALE and loser.current == held


def test_delete_is_conditional_on_the_version(table: str) -> None:
    target = _target(table)
    v1 = _seed(target, "gone", {"a": 1})
    moved = target.write("gone", {"a": 2}, expected_version=v1, fence=2, idempotency_key=_key())
    stale = target.delete("gone", expected_version=v1, fence=3, idempotency_key=_key())
    assert stale.outcome is Outcome.STALE and stale.current is not None
    assert stale.current.document == {"a": 2}
    assert moved.version is not None
    done = target.delete("gone", expected_version=moved.version, fence=3, idempotency_key=_key())
    assert done.applied and target.read("gone") == ABSENT
    missing = target.delete("gone", expected_version=moved.version, fence=4, idempotency_key=_key())
    assert missing.outcome is Outcome.STALE and missing.current == ABSENT


def test_settle_by_reading_applied_not_applied_and_conflict(table: str) -> None:
    target = _target(table)
    v1 = _seed(target, "s", {"x": 1})
    # Not applied: nothing happened since the version we wrote on.
    settled = settle_by_reading(target, "s", written_document={"x": 2}, observed_version=v1)
    assert isinstance(settled, NotApplied) and settled.current.version == v1
    # Applied once: the worker died after the target applied, before anything was recorded.
    target.write("s", {"x": 2}, expected_version=v1, fence=2, idempotency_key=_key())
    settled = settle_by_reading(target, "s", written_document={"x": 2}, observed_version=v1)
    assert settled == Applied("2")
    # Conflict: someone else wrote after us; a second blind attempt would overwrite them.
    target.write("s", {"x": 5}, expected_version="2", fence=3, idempotency_key=_key())
    settled = settle_by_reading(target, "s", written_document={"x": 2}, observed_version=v1)
    assert isinstance(settled, Conflict) and settled.current.document == {"x": 5}
    # A create and a delete settle the same way.
    assert isinstance(
        settle_by_reading(target, "nope", written_document={"x": 1}, observed_version=None),
        NotApplied,
    )
    target.delete("s", expected_version="3", fence=4, idempotency_key=_key())
    assert settle_by_reading(
        target, "s", written_document=None, observed_version="3", deleted=True
    ) == Applied(None)


def test_a_connection_killed_mid_write_is_unknown_then_settled(table: str, rows_db: str) -> None:
    """The real unknown outcome: the UPDATE was sent and its connection died before the
    answer. The adapter says `unknown` (never applied, never failed), and reading settles it."""
    target = _target(table, lock_timeout=60)
    v1 = _seed(target, "k", {"x": 1})
    holder = psycopg.connect(rows_db)
    holder.execute(
        sql.SQL("SELECT 1 FROM {} WHERE name = 'k' FOR UPDATE").format(sql.Identifier(table))
    )
    results: list[Any] = []
    writer = threading.Thread(
        target=lambda: results.append(
            target.write("k", {"x": 2}, expected_version=v1, fence=2, idempotency_key=_key())
        )
    )
    writer.start()
    with psycopg.connect(rows_db, autocommit=True) as killer:
        for _ in range(100):
            row = killer.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE 'UPDATE%%' AND wait_event_type = 'Lock'"
            ).fetchone()
            if row:
                break
            time.sleep(0.05)
        assert row, "the write never blocked on the row lock"
        killer.execute("SELECT pg_terminate_backend(%s)", [row[0]])
    writer.join(10)
    holder.rollback()
    holder.close()
    assert results and results[0].outcome is Outcome.UNKNOWN, results
    assert isinstance(
        settle_by_reading(target, "k", written_document={"x": 2}, observed_version=v1), NotApplied
    )


def test_a_held_row_lock_is_locked_backoff_not_a_failure(table: str, rows_db: str) -> None:
    target = _target(table, lock_timeout=0.2)
    v1 = _seed(target, "busy", {"x": 1})
    with psycopg.connect(rows_db) as holder:
        holder.execute(
            sql.SQL("SELECT 1 FROM {} WHERE name = 'busy' FOR UPDATE").format(sql.Identifier(table))
        )
        result = target.write(
            "busy", {"x": 2}, expected_version=v1, fence=2, idempotency_key=_key()
        )
        holder.rollback()
    assert result.outcome is Outcome.LOCKED
    assert target.read("busy").document == {"x": 1}


def test_named_columns_text_versions_and_xmin(
    rows_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, rows_db)
    with psycopg.connect(rows_db, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS plans (code text PRIMARY KEY, seats integer, "
            "label text, rev text NOT NULL)"
        )
        conn.execute("CREATE TABLE IF NOT EXISTS tags (code text PRIMARY KEY, body jsonb)")
    named = PostgresTarget(
        PostgresSettings.from_settings(
            {
                "credentials_env": ENV,
                "table": "plans",
                "key_column": "code",
                "columns": {"seats": "seats", "label": "label"},
                "version_column": "rev",
                "version_type": "text",
            }
        )
    )
    created = named.create("gold", {"seats": 5, "label": "Gold"}, fence=1, idempotency_key=_key())
    assert created.applied and created.version and len(created.version) == 36
    assert named.read("gold").document == {"seats": 5, "label": "Gold"}
    written = named.write(
        "gold",
        {"seats": 6, "label": "Gold+"},
        expected_version=created.version,
        fence=2,
        idempotency_key=_key(),
    )
    assert written.applied and written.version not in (None, created.version)
    stale = named.write(
        "gold", {"seats": 1}, expected_version=created.version, fence=3, idempotency_key=_key()
    )
    assert stale.outcome is Outcome.STALE
    unmapped = named.write(
        "gold",
        {"owner": "x"},
        expected_version=str(written.version),
        fence=3,
        idempotency_key=_key(),
    )
    assert unmapped.outcome is Outcome.FAILED and "owner" in unmapped.detail
    bad_type = named.write(
        "gold",
        {"seats": "many"},
        expected_version=str(written.version),
        fence=3,
        idempotency_key=_key(),
    )
    assert bad_type.outcome is Outcome.FAILED and named.read("gold").document["seats"] == 6

    by_xmin = PostgresTarget(
        PostgresSettings.from_settings(
            {
                "credentials_env": ENV,
                "table": "tags",
                "key_column": "code",
                "document_column": "body",
            }
        )
    )
    v1 = by_xmin.create("t", {"a": 1}, fence=1, idempotency_key=_key()).version
    assert v1 is not None and by_xmin.read("t").version == v1
    v2 = by_xmin.write("t", {"a": 2}, expected_version=v1, fence=2, idempotency_key=_key())
    assert v2.applied and v2.version != v1 and by_xmin.read("t").version == v2.version
    assert (
        by_xmin.write("t", {"a": 3}, expected_version=v1, fence=3, idempotency_key=_key()).outcome
        is Outcome.STALE
    )


@pytest.mark.parametrize(
    ("dsn", "why"),
    [
        (f"postgresql://postgres:{PASSWORD} x@127.0.0.1:5432/db", "psycopg quotes a bad DSN"),
        (f"host=127.0.0.1 password='{PASSWORD}' dbname=nodb_{PASSWORD}", "no such database"),
        (f"postgresql://postgres:{PASSWORD}@127.0.0.1:1/db", "refused"),
    ],
)
def test_a_credential_never_appears_in_errors_or_logs(
    dsn: str,
    why: str,
    table: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(ENV, dsn)
    target = _target(table)
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    try:
        target.read("acme")
    except TargetError as exc:
        texts += [str(exc), repr(exc), repr(exc.__context__), repr(exc.__cause__)]
    else:
        pytest.fail("a read through a broken DSN succeeded")
    result = target.write("acme", {"a": 1}, expected_version="1", fence=1, idempotency_key=_key())
    assert result.outcome is Outcome.NOT_SENT, (why, result)
    texts += [result.detail, repr(result), repr(target.settings), caplog.text]
    for text in texts:
        assert PASSWORD not in text, (why, text)
        assert PASSWORD.replace("-", "%2D") not in text


def test_a_credential_never_appears_when_the_server_answers_an_error(
    rows_db: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Trust authentication ignores the password, so the connection works and the error
    (no such table) comes from the server; the password is still nowhere."""
    parts = urlsplit(rows_db)
    monkeypatch.setenv(
        ENV, urlunsplit(parts._replace(netloc=f"postgres:{PASSWORD}@{parts.hostname}:{parts.port}"))
    )
    caplog.set_level(logging.DEBUG)
    target = _target("no_such_table")
    result = target.write("a", {"a": 1}, expected_version="1", fence=1, idempotency_key=_key())
    assert result.outcome is Outcome.FAILED and "no_such_table" in result.detail
    with pytest.raises(TargetError) as raised:
        target.read("a")
    for text in (result.detail, str(raised.value), caplog.text):
        assert PASSWORD not in text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"table": "users; drop table x"}, "table"),
        ({"table": 'Robert"'}, "table"),
        ({"key_column": "Name"}, "key_column"),
        ({"schema": "public.x"}, "schema"),
        ({"fence_column": "a" * 64}, "fence_column"),
        ({"columns": {"a": "b"}}, "exactly one of"),
        ({"document_column": None}, "exactly one of"),
        ({"credentials_env": "postgres://u:p@h/db"}, "credentials_env"),
        ({"version_type": "float"}, "version_type"),
        ({"version_column": "doc"}, "must all differ"),
        ({"version_column": "xmin"}, "xmin"),
        ({"password": "x"}, "unknown setting"),
        ({"lock_timeout": -1}, "lock_timeout"),
    ],
)
def test_bad_settings_are_refused_with_the_setting_named(
    change: dict[str, Any], message: str
) -> None:
    settings: dict[str, Any] = {
        "credentials_env": ENV,
        "table": "t",
        "key_column": "name",
        "document_column": "doc",
        "version_column": "version",
    }
    settings.update(change)
    settings = {k: v for k, v in settings.items() if v is not None}
    with pytest.raises(TargetConfigError, match=message):
        PostgresSettings.from_settings(settings)


def test_a_missing_credentials_variable_is_not_sent(
    table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV)
    result = _target(table).write("a", {}, expected_version="1", fence=1, idempotency_key=_key())
    assert result.outcome is Outcome.NOT_SENT and ENV in result.detail


def test_a_document_that_is_not_json_fails_without_a_statement(table: str) -> None:
    target = _target(table)
    v1 = _seed(target, "j", {"a": 1})
    for document in ({"a": float("nan")}, {"a": {1, 2}}):
        result = target.write("j", document, expected_version=v1, fence=2, idempotency_key=_key())
        assert result.outcome is Outcome.FAILED and "not JSON" in result.detail
    assert target.read("j").version == v1


# --- Connections kept between calls (engine/targets/pg_pool.py): two writes share one server
# session; a session the server ended while idle is replaced, never used for a write (the
# write applies, once); a rotated credential in the environment gets sessions of its own.


@pytest.fixture
def fresh_pools() -> Iterator[None]:
    pg_pool.close_all()
    yield
    pg_pool.close_all()


@pytest.fixture
def column_table(rows_db: str, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"p_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(rows_db, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (name text PRIMARY KEY, doc jsonb NOT NULL, "
                "version bigint NOT NULL, backend int)"
            ).format(sql.Identifier(name))
        )
    monkeypatch.setenv(ENV, rows_db)
    return name


def _column_target(table: str) -> PostgresTarget:
    return PostgresTarget(
        PostgresSettings.from_settings(
            {
                "credentials_env": ENV,
                "table": table,
                "key_column": "name",
                "columns": {"n": "doc", "backend": "backend"},
                "version_column": "version",
            }
        )
    )


def _sessions(rows_db: str) -> list[int]:
    """The server sessions connected to the rows database, but this one."""
    with psycopg.connect(rows_db, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        ).fetchall()
    return [row[0] for row in rows]


def _pooled_write(target: PostgresTarget, version: str, n: int) -> Any:
    return target.write(
        "acme",
        {"n": {"n": n}, "backend": None},
        expected_version=version,
        fence=n,
        idempotency_key=f"k-{uuid.uuid4()}",
    )


@pytest.mark.usefixtures("fresh_pools")
def test_calls_share_one_session_and_a_session_ended_while_idle_is_replaced(
    rows_db: str,
    column_table: str,
) -> None:
    target = _column_target(column_table)
    created = target.create(
        "acme", {"n": {"n": 0}, "backend": None}, fence=1, idempotency_key="seed"
    )
    assert created.outcome is Outcome.APPLIED and created.version == "1"
    first = _pooled_write(target, "1", 2)
    assert first.outcome is Outcome.APPLIED
    [session] = _sessions(rows_db)
    second = _pooled_write(target, "2", 3)
    assert second.outcome is Outcome.APPLIED
    assert _sessions(rows_db) == [session]  # the same session carried both writes

    # The server ends the idle session (a restart, a DBA, a dropped database): the next
    # write is not sent on it; it applies once, on a new session.
    with psycopg.connect(rows_db, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", [session])
    third = _pooled_write(target, "3", 4)
    assert third.outcome is Outcome.APPLIED and third.version == "4"
    [replacement] = _sessions(rows_db)
    assert replacement != session
    assert target.read("acme").document == {"n": {"n": 4}, "backend": None}


@pytest.mark.usefixtures("fresh_pools")
def test_a_rotated_credential_gets_sessions_of_its_own(
    rows_db: str,
    column_table: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = _column_target(column_table)
    assert target.create("acme", {"n": 1, "backend": None}, fence=1, idempotency_key="s").version
    [before] = _sessions(rows_db)
    # The same server under another connection string (as a rotated password would be).
    monkeypatch.setenv(ENV, f"{rows_db}?application_name=rotated")
    assert target.read("acme").exists
    with psycopg.connect(rows_db, autocommit=True) as conn:
        names = dict(
            conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        )
    assert before in names and "rotated" in names.values()
