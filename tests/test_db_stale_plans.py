"""A migration that changes a column's type while the processes run does not fail their
reads until the connections recycle (console/stale_plans.py): a statement PostgreSQL
refuses with `cached plan must not change result type` is run again once, after the
connection's prepared statements are dropped, wherever it opens its transaction — Django's
cursors (console/pgbackend) and the poll front's own (approvals/api/fastpoll_sql.py).
Real PostgreSQL; the ALTER comes from a second, real connection between two executions
of the same prepared statement."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from django.conf import settings

from approvals.api.fastpoll_sql import Connections, connection_kwargs
from approvals.models import Action
from tests.conftest import free_port, test_database_url
from tests.deployload import default_environment, script_json, seed_poll_target, start_procfile_web

# In a web-like process (its one pooled connection lent to every query) or a worker-like
# one (a persistent connection): the same SELECT run until psycopg prepared it
# (prepare_threshold, console/settings.py), then the column it returns changes type from
# another session, between two of its executions.
_READS = """
import json, sys
import psycopg
LOADER
from django.db import connection, transaction

table = sys.argv[2]
admin = psycopg.connect(sys.argv[1], autocommit=True)
SELECT = f"SELECT v FROM {table} WHERE id = %s"


def read():
    with connection.cursor() as cursor:
        cursor.execute(SELECT, [1])
        return cursor.fetchone()[0]


def outcome(work):
    try:
        return repr(work())
    except Exception as error:
        return type(error).__name__ + ": " + str(error).splitlines()[0]


def in_transaction(first):
    with transaction.atomic():
        if not first:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        return read()


answers = {}
for _ in range(8):
    read()
pid = connection.connection.info.backend_pid
admin.execute(f"ALTER TABLE {table} ALTER COLUMN v TYPE text")
answers["autocommit"] = outcome(read)
for _ in range(8):
    read()
admin.execute(f"ALTER TABLE {table} ALTER COLUMN v TYPE bigint USING v::bigint")
answers["first_in_transaction"] = outcome(lambda: in_transaction(True))
for _ in range(8):
    read()
admin.execute(f"ALTER TABLE {table} ALTER COLUMN v TYPE text")
answers["later_in_transaction"] = outcome(lambda: in_transaction(False))
answers["after_that_rollback"] = outcome(read)
answers["same_session"] = connection.connection.info.backend_pid == pid
answers["pooled"] = connection.pool is not None
connection.close()
print(json.dumps(answers))
"""


@pytest.fixture
def probe_table() -> Iterator[str]:
    """A table of the test's own in the test database: (id 1, v 2)."""
    name = f"stale_plan_probe_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(test_database_url(), autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {name} (id integer PRIMARY KEY, v integer)")
        admin.execute(f"INSERT INTO {name} VALUES (1, 2)")  # noqa: S608 (the name is ours)
    try:
        yield name
    finally:
        with psycopg.connect(test_database_url(), autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {name}")


# A web process (its connections pooled) and a worker's (one persistent connection).
_LOADERS = {
    "web": "import console.asgi",
    "worker": "import django; django.setup()",
}


@pytest.mark.parametrize("process", sorted(_LOADERS))
@pytest.mark.django_db
def test_a_processs_connection_reads_on_after_a_column_changes_type(
    probe_table: str, process: str
) -> None:
    url = test_database_url()
    environment = default_environment(
        DATABASE_URL=url, AIRLOCK_DB_POOL_MAX="1", AIRLOCK_DB_POOL_MIN="1"
    )
    script = _READS.replace("LOADER", _LOADERS[process])
    seen = script_json(script, url, probe_table, environment=environment)
    assert seen["pooled"] is (process == "web"), seen
    # On its own (autocommit) and as the first statement of a transaction, the read
    # runs again and returns the column's new type.
    assert seen["autocommit"] == "'2'", seen
    assert seen["first_in_transaction"] == "2", seen
    # After another statement of the same transaction, running it again would not be
    # the same transaction: the error is the answer, and the rollback that ends the
    # transaction drops the stale plans, so the next read succeeds.
    assert seen["later_in_transaction"].startswith("NotSupportedError: cached plan"), seen
    assert seen["after_that_rollback"] == "'2'", seen
    assert seen["same_session"], seen  # no reconnection did it


@pytest.mark.django_db
def test_the_poll_fronts_connections_read_on_after_a_column_changes_type(
    probe_table: str,
) -> None:
    select = f"SELECT v FROM {probe_table} WHERE id = %s"  # noqa: S608 (the name is ours)

    async def scenario() -> tuple[list[tuple[object, ...]], list[tuple[object, ...]], bool]:
        pool = Connections(connection_kwargs(), 1)
        before = await pool.rows(select, (1,))  # prepared at once (prepare=True)
        pid = pool.idle[0].connection.info.backend_pid
        with psycopg.connect(test_database_url(), autocommit=True) as admin:
            admin.execute(f"ALTER TABLE {probe_table} ALTER COLUMN v TYPE text")
        after = await pool.rows(select, (1,))
        same = pool.idle[0].connection.info.backend_pid == pid
        await pool.idle[0].connection.close()
        return before, after, same

    before, after, same = asyncio.run(scenario())
    assert before == [(2,)]
    assert after == [("2",)]
    assert same  # the connection kept, its statements re-prepared


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_web_process_answers_polls_across_a_column_type_migration(tmp_path: Path) -> None:
    """The Procfile's `web` line serving both poll paths (a run token: the poll front; an
    agent token: Django) until their statements are prepared; a migration changes the
    type of a column both read (actions.revision); every later poll is a 200."""
    target = seed_poll_target(1)
    env = default_environment(
        DATABASE_URL=test_database_url(),
        REDIS_URL=settings.REDIS_URL,
        AIRLOCK_DATA_DIR=str(tmp_path / "data"),
    )
    web = start_procfile_web(env, free_port(), tmp_path / "web.log")
    table = Action._meta.db_table
    statuses: Counter[tuple[str, int]] = Counter()
    try:
        with httpx.Client(base_url=web.url, timeout=30) as client:

            def polls(rounds: int) -> Counter[tuple[str, int]]:
                seen: Counter[tuple[str, int]] = Counter()
                for _ in range(rounds):
                    for name, token in (("front", target.run_token), ("django", target.tokens[0])):
                        answer = client.get(
                            target.path, headers={"Authorization": f"Bearer {token}"}
                        )
                        seen[(name, answer.status_code)] += 1
                return seen

            assert set(polls(60)) == {("front", 200), ("django", 200)}
            with psycopg.connect(test_database_url(), autocommit=True) as admin:
                admin.execute(f'ALTER TABLE "{table}" ALTER COLUMN revision TYPE bigint')
            try:
                statuses = polls(30)
            finally:
                with psycopg.connect(test_database_url(), autocommit=True) as admin:
                    admin.execute(f'ALTER TABLE "{table}" ALTER COLUMN revision TYPE integer')
    finally:
        web.stop()
    assert statuses == Counter({("front", 200): 30, ("django", 200): 30}), (
        f"{statuses}\n{web.output()[-3000:]}"
    )
