"""The web processes' pooled connections (console/pgbackend): a loan costs no round trip
while the server has said nothing, and a connection whose session PostgreSQL ended (a
restart, `pg_terminate_backend`) is still replaced before a request uses it — the promise
Django's round-trip check kept. Real PostgreSQL; the pool lives in a subprocess that
loads console.asgi, as a web process does."""

from __future__ import annotations

import asyncio
import os
import time

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from console.pgbackend.base import answered_nothing, returned_on_error
from tests.conftest import test_database_url
from tests.deployload import default_environment, script_json

# Runs in a web-like process with a pool of ONE connection, so every loan is that one.
_LOANS = """
import json, sys, time
import psycopg
import console.asgi  # a web process: its connections are pooled
from django.conf import settings
from django.db import connection

admin = psycopg.connect(sys.argv[1], autocommit=True)


def last_statement(pid):
    row = admin.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    return None if row is None else row[0]


def loan_and_ask(sql):
    with connection.cursor() as cursor:
        cursor.execute(sql)
        pid = cursor.fetchone()[0]
    connection.close()  # back to the pool
    return pid


first = loan_and_ask("SELECT pg_backend_pid() AS marked_statement")
connection.ensure_connection()  # a loan, and no statement of ours
seen_after_loan = last_statement(first)
same = connection.connection.info.backend_pid == first
connection.close()

admin.execute("SELECT pg_terminate_backend(%s)", [first])
deadline = time.monotonic() + 10
while last_statement(first) is not None and time.monotonic() < deadline:
    time.sleep(0.02)
second = loan_and_ask("SELECT pg_backend_pid()")
print(json.dumps({
    "engine": settings.DATABASES["default"]["ENGINE"],
    "max_size": settings.DATABASES["default"]["OPTIONS"]["pool"]["max_size"],
    "first": first,
    "same_connection_lent": same,
    "seen_after_loan": seen_after_loan,
    "second": second,
}))
"""


@pytest.mark.django_db
def test_a_quiet_pooled_connection_is_lent_without_a_round_trip_and_a_dead_one_is_replaced() -> (
    None
):
    url = test_database_url()
    environment = default_environment(
        DATABASE_URL=url, AIRLOCK_DB_POOL_MAX="1", AIRLOCK_DB_POOL_MIN="1"
    )
    seen = script_json(_LOANS, url, environment=environment)
    assert seen["engine"] == "console.pgbackend" and seen["max_size"] == 1
    assert seen["same_connection_lent"]
    # Django's check would have sent an empty query on the loan: the server's record of
    # the session's last statement would then be "".
    assert seen["seen_after_loan"] == "SELECT pg_backend_pid() AS marked_statement"
    # The terminated session's connection was found dead at the loan and replaced: the
    # request that borrowed after it ran on a new backend, without an error.
    assert seen["second"] != seen["first"]


def test_a_connection_is_quiet_until_the_server_ends_its_session() -> None:
    url = test_database_url()
    with psycopg.connect(url, autocommit=True) as admin, psycopg.connect(url) as lent:
        lent.execute("SELECT 1").fetchone()
        lent.rollback()
        assert answered_nothing(lent)
        admin.execute("SELECT pg_terminate_backend(%s)", [lent.info.backend_pid])
        deadline = time.monotonic() + 10
        while answered_nothing(lent) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not answered_nothing(lent)


def test_a_connection_on_a_descriptor_above_1023_is_judged_without_an_error() -> None:
    """select() refuses a descriptor >= 1024 (FD_SETSIZE) with ValueError; a web process
    holding a thousand polls has its newer database sockets there."""
    null = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(null) for _ in range(1100)]  # the lowest free descriptors, taken
    try:
        url = test_database_url()
        with psycopg.connect(url, autocommit=True) as admin, psycopg.connect(url) as lent:
            assert lent.fileno() >= 1024
            lent.execute("SELECT 1").fetchone()
            lent.rollback()
            assert answered_nothing(lent)
            admin.execute("SELECT pg_terminate_backend(%s)", [lent.info.backend_pid])
            deadline = time.monotonic() + 10
            while answered_nothing(lent) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not answered_nothing(lent)
    finally:
        for descriptor in [*held, null]:
            os.close(descriptor)


@pytest.mark.parametrize("interruption", [ValueError, KeyboardInterrupt, asyncio.CancelledError])
def test_a_loan_interrupted_in_its_check_goes_back_to_the_pool(
    interruption: type[BaseException],
) -> None:
    """Whatever escapes the check of a lent connection — an error the check did not
    expect, an interrupt, a cancellation — the connection is back in a real pool
    afterwards, not lent to no one for the life of the process."""
    with ConnectionPool(test_database_url(), min_size=1, max_size=1, open=True) as pool:
        lent = pool.getconn()
        with pytest.raises(interruption), returned_on_error(pool, lent):
            raise interruption
        assert pool.get_stats().get("pool_available") == 1
        again = pool.getconn(timeout=2)  # the one connection, lendable again
        pool.putconn(again)
