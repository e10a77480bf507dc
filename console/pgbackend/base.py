"""Django's PostgreSQL backend, lending pooled connections checked without a round trip,
and surviving a migration that changes what a prepared statement returns.

With CONN_HEALTH_CHECKS, Django gives psycopg's pool `ConnectionPool.check_connection` as
its check, which sends an empty query on every loan: a round trip on every request that
touches the database (a person's decision among them), before its first statement.

An idle connection has nothing to read unless the server spoke unasked: when PostgreSQL
ends a session (a restart, `pg_terminate_backend`, `idle_session_timeout`) it sends the
error and closes the socket, which makes it readable. So a loaned connection whose socket
is quiet is used as it is; one whose socket has something to say gets the full check, and
one that fails it goes back to the pool (which discards a broken connection) for another.
The settings turn CONN_HEALTH_CHECKS off for the pool: this check replaces Django's.

The socket is asked with poll(2), which takes any descriptor: select(2) refuses one >= 1024
(FD_SETSIZE), and a web process holding a thousand long-polls has its newer database
sockets above that. Whatever interrupts the check, the lent connection goes back to the
pool: a connection lost there is lost for the life of the process, and once the pool has
lost them all every request waits its timeout and answers 503.

Statements run through `ServerBindingCursor`, which runs once more a statement PostgreSQL
refused because a migration changed its prepared plan's result type (console/stale_plans.py)
when that is safe: the statement opens its transaction (autocommit, or the first of an
atomic block), so nothing earlier is lost by rolling back.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db.backends.postgresql import base
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from console.stale_plans import DEALLOCATE_ALL, is_stale_plan

logger = logging.getLogger(__name__)


def answered_nothing(connection: psycopg.Connection[Any]) -> bool:
    """Is this idle connection open with nothing unread from the server? No I/O."""
    if connection.closed or connection.broken:
        return False
    poller = select.poll()
    poller.register(connection.fileno(), select.POLLIN)
    # Readable, hung up or in error: any event means the server has something to say.
    return not poller.poll(0)


def alive(connection: psycopg.Connection[Any]) -> bool:
    """Quiet, or else answering psycopg_pool's own check (one round trip)."""
    if answered_nothing(connection):
        return True
    try:
        ConnectionPool.check_connection(connection)
    except psycopg.Error:
        return False
    return True


@contextmanager
def returned_on_error(
    pool: ConnectionPool[Any], connection: psycopg.Connection[Any]
) -> Iterator[None]:
    """The loan of `connection` ends with the block if anything escapes it (any exception,
    a KeyboardInterrupt or a cancellation too): back to the pool, which discards it if
    broken, instead of lent to no one forever."""
    try:
        yield
    except BaseException:
        pool.putconn(connection)
        raise


def forget_prepared_statements(connection: psycopg.Connection[Any]) -> None:
    """Drop the session's prepared statements, on the server and in psycopg's cache."""
    if connection.info.transaction_status == TransactionStatus.INERROR:
        # The failed statement opened this transaction (the caller checked): psycopg's
        # rollback also deallocates every prepared statement and forgets their names.
        connection.rollback()
    else:
        connection.execute(DEALLOCATE_ALL, prepare=False)


# (psycopg.Cursor is already base.ServerBindingCursor's base: named for django-stubs, which omit it)
class ServerBindingCursor(base.ServerBindingCursor, psycopg.Cursor[Any]):
    """Django's server-binding cursor, running once more a statement refused for a stale
    prepared plan when it opened its transaction (see the module doc)."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        connection = self.connection
        opens_transaction = connection.info.transaction_status == TransactionStatus.IDLE
        try:
            return super().execute(query, params, **kwargs)
        except psycopg.errors.FeatureNotSupported as error:
            if not (opens_transaction and is_stale_plan(error)):
                raise
            logger.warning("a migration changed a prepared statement's result: re-preparing")
        forget_prepared_statements(connection)
        return super().execute(query, params, **kwargs)


class DatabaseWrapper(base.DatabaseWrapper):
    def get_connection_params(self) -> dict[str, Any]:
        params: dict[str, Any] = super().get_connection_params()
        if params.get("cursor_factory") is base.ServerBindingCursor:
            params["cursor_factory"] = ServerBindingCursor
        return params

    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        connection = super().get_new_connection(conn_params)
        pool = self.pool
        if pool is None:
            return connection
        # Every connection the pool holds may have died with the server: try each once.
        for _ in range(pool.max_size):
            with returned_on_error(pool, connection):
                usable = alive(connection)
            if usable:
                return connection
            pool.putconn(connection)  # broken: the pool drops it and opens another
            connection = super().get_new_connection(conn_params)
        with returned_on_error(pool, connection):
            ConnectionPool.check_connection(connection)  # the last one: its error is the answer
        return connection
