"""Django's PostgreSQL backend, lending pooled connections checked without a round trip.

With CONN_HEALTH_CHECKS, Django gives psycopg's pool `ConnectionPool.check_connection` as
its check, which sends an empty query on every loan: a round trip on every request that
touches the database (a person's decision among them), before its first statement.

An idle connection has nothing to read unless the server spoke unasked: when PostgreSQL
ends a session (a restart, `pg_terminate_backend`, `idle_session_timeout`) it sends the
error and closes the socket, which makes it readable. So a loaned connection whose socket
is quiet is used as it is; one whose socket has something to say gets the full check, and
one that fails it goes back to the pool (which discards a broken connection) for another.
The settings turn CONN_HEALTH_CHECKS off for the pool: this check replaces Django's.
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool


def answered_nothing(connection: psycopg.Connection[Any]) -> bool:
    """Is this idle connection open with nothing unread from the server? No I/O."""
    if connection.closed or connection.broken:
        return False
    readable, _, _ = select.select([connection.fileno()], [], [], 0)
    return not readable


def alive(connection: psycopg.Connection[Any]) -> bool:
    """Quiet, or else answering psycopg_pool's own check (one round trip)."""
    if answered_nothing(connection):
        return True
    try:
        ConnectionPool.check_connection(connection)
    except psycopg.Error:
        return False
    return True


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        connection = super().get_new_connection(conn_params)
        pool = self.pool
        if pool is None:
            return connection
        # Every connection the pool holds may have died with the server: try each once.
        for _ in range(pool.max_size):
            if alive(connection):
                return connection
            pool.putconn(connection)  # broken: the pool drops it and opens another
            connection = super().get_new_connection(conn_params)
        ConnectionPool.check_connection(connection)  # the last one: its error is the answer
        return connection
