"""Helpers for forced-collision tests: threads on their own database connections,
transactions held open on purpose, and waiting for PostgreSQL to report a backend
blocked on a lock (a condition, never a delay)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import OperationalError, connection, connections, transaction

WAIT = 20.0  # seconds: an upper bound for a forced step, never a synchronisation


class Worker(threading.Thread):
    """Runs `fn` on its own database connection; keeps its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the test
            self.error = exc
        finally:
            connections.close_all()

    def finish(self) -> Any:
        self.join(WAIT)
        assert not self.is_alive(), "thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


class Holder(Worker):
    """Runs `fn` inside a transaction and keeps it open until `release()`."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.ready = threading.Event()
        self.go = threading.Event()

        def held() -> Any:
            with transaction.atomic():
                value = fn()
                self.ready.set()
                assert self.go.wait(WAIT), "never released"
            return value

        super().__init__(held)

    def hold(self) -> Holder:
        self.start()
        assert self.ready.wait(WAIT), "holder did not get there"
        return self

    def release(self) -> Any:
        self.go.set()
        return self.finish()


def finish_each(*threads: Worker) -> list[OperationalError]:
    """Finishes every thread in turn; the OperationalErrors (a deadlock, a serialisation
    failure) they raised. Any other error is raised at once."""
    errors: list[OperationalError] = []
    for thread in threads:
        try:
            thread.finish()
        except OperationalError as exc:
            errors.append(exc)
    return errors


def over_sessions(aggregate: str, *, where: str) -> int:
    """`aggregate` (a count) over the sessions on the test database that match `where`
    (both SQL written by the tests, never input)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {aggregate} FROM pg_stat_activity "  # noqa: S608
            f"WHERE datname = current_database() AND {where}"
        )
        return int(cursor.fetchone()[0])


def lock_waiters() -> int:
    """How many backends on the test database wait on a lock right now."""
    return over_sessions("count(*)", where="wait_event_type = 'Lock'")


def wait_for_lock_waiters(count: int, *, threads: tuple[Worker, ...] = ()) -> None:
    """Poll PostgreSQL until `count` backends wait on a lock; a thread that finishes
    instead of waiting fails the test with its own error."""
    deadline = time.monotonic() + WAIT
    while lock_waiters() < count:
        for thread in threads:
            if not thread.is_alive():
                thread.finish()  # surfaces its error
                raise AssertionError("a thread finished instead of waiting for the lock")
        assert time.monotonic() < deadline, f"{count} lock waiter(s) never appeared"
        time.sleep(0.01)


def wait_until_blocked_or_finished(thread: Worker) -> None:
    """Until PostgreSQL reports a backend waiting on a lock, or the thread has ended."""
    deadline = time.monotonic() + WAIT
    while thread.is_alive() and lock_waiters() < 1:
        assert time.monotonic() < deadline, "the thread neither blocked nor finished"
        time.sleep(0.005)
