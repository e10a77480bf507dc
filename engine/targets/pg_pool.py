"""The PostgreSQL target's connections, kept between calls: a few idle connections per
connection string, per process.

Opening a connection costs more than the conditional UPDATE it carries (TCP, the startup
packet, authentication: about 3 times the statement on loopback, bench/targets.py), and the
Procfile's worker is a SimpleWorker that lives for many jobs. So a call takes an idle
connection when there is one and gives it back afterwards; with none idle it connects
exactly as before (the same errors, as fast: a refused connection fails at once).

The key is the connection string with the session options; the string is read from the
environment at each call (the adapter), so a rotated credential simply gets connections of
its own, and the old ones are closed when next seen idle too long. It lives only in this
process's memory, never in a message.

An idle connection is checked with one empty round trip before it carries a write (still far
cheaper than connecting): one that broke while idle (the target restarted, its database was
dropped and made again) is replaced instead of failing a write with an ambiguous answer. One
that breaks between the check and the write fails it as a broken connection does (unknown →
settled by reading): slower, never wrong.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

# Idle connections kept per connection string and process: the worker writes one action at a
# time, a web process reads through for a few requests at once.
MAX_IDLE = 4
# Beyond this idle time a connection is closed instead of reused (the target's limits).
MAX_IDLE_SECONDS = 60.0

_Key = tuple[str, int, str]
_idle: dict[_Key, list[tuple[float, psycopg.Connection[Any]]]] = {}
_lock = threading.Lock()


def _take(key: _Key) -> psycopg.Connection[Any] | None:
    """The most recently used idle connection that is still good, or None."""
    now = time.monotonic()
    while True:
        with _lock:
            stack = _idle.get(key)
            if not stack:
                return None
            since, connection = stack.pop()
        if now - since > MAX_IDLE_SECONDS or connection.closed:
            connection.close()
            continue
        try:
            connection.execute("")
        except psycopg.Error:
            connection.close()
            continue
        return connection


def _give_back(key: _Key, connection: psycopg.Connection[Any]) -> None:
    reusable = (
        not connection.closed and connection.info.transaction_status == TransactionStatus.IDLE
    )
    if reusable:
        with _lock:
            stack = _idle.setdefault(key, [])
            if len(stack) < MAX_IDLE:
                stack.append((time.monotonic(), connection))
                return
    connection.close()


@contextmanager
def pooled_connection(
    dsn: str, *, connect_timeout: int, options: str
) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to `dsn` with `options` set: an idle one of this process's,
    or a new one (psycopg.connect's own errors when it cannot be made). Given back for reuse
    when the block ends cleanly; closed when it raised."""
    key = (dsn, connect_timeout, options)
    connection = _take(key)
    if connection is None:
        connection = psycopg.connect(
            dsn, autocommit=True, connect_timeout=connect_timeout, options=options
        )
    try:
        yield connection
    except BaseException:
        connection.close()
        raise
    _give_back(key, connection)


def close_all() -> None:
    """Close every idle connection of this process (tests; a process about to exit)."""
    with _lock:
        stacks = list(_idle.values())
        _idle.clear()
    for stack in stacks:
        for _, connection in stack:
            connection.close()
