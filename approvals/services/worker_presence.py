"""Is the worker that holds a piece of work still alive? (issue 38: resumed within 30 s)

A lease (`Operation.lease_expires_at`) and a resource lock outlive the worker that took
them by their whole length (32 s and 30 s by default), and RQ itself notices a
SimpleWorker that died inside a job only after the job's timeout plus a minute. So the
Procfile's worker (approvals.worker.EngineWorker) publishes its presence: a key
`airlock:worker:alive:<name>` that a daemon thread of the worker process sets again every
PRESENCE_BEAT_SECONDS, expiring PRESENCE_TTL_SECONDS after the last beat. A SIGKILL, an
OOM kill or a lost machine stops the beats; the key expires.

The worker's name, `<host>:<pid>@<boot token>` (the `@` marks a worker that publishes its
presence), is the RQ worker's name, what it stamps on the operations it claims
(`Operation.worker`) and part of the token of every lock it takes. The reconciler
(approvals.services.reconcile) abandons the operations of a worker that is gone at once,
without waiting for their leases, and resends the jobs RQ still shows as started by it;
a delivery that finds a resource's lock held by a gone worker deletes that lock (only if
it still holds that very token) instead of waiting out its TTL.

A missing key is confirmed before it counts as a death: looked at again after a beat has
had time to land (a Redis FLUSHALL or restart also drops the keys of live workers, which
set them again on their next beat), then remembered (`airlock:worker:gone:<name>`, an hour)
so that the next look need not wait. Mistaking a live worker for a dead one would cost a
redone attempt, never a second write: the fence and the operation's status refuse the
overtaken holder, as after any expired lease.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Collection

import redis

from approvals.outbox import engine_redis
from engine.core.errors import LockBusy
from engine.core.lock import FencedLock

log = logging.getLogger("airlock.presence")

PRESENCE_TTL_SECONDS = 8
PRESENCE_BEAT_SECONDS = 2.0
# A missing key is looked at again this much later: after the live worker's next beat.
CONFIRM_AFTER_SECONDS = PRESENCE_BEAT_SECONDS + 1.0
GONE_MEMORY_SECONDS = 3600
_ALIVE = "airlock:worker:alive:"
_GONE = "airlock:worker:gone:"
# A lock token is `[<action id>:]<holder>:<32 hex>`; a presence-publishing holder's name
# is `<host>:<pid>@<boot token>`.
_WORKER_IN_TOKEN = re.compile(r"(?:^|:)([^:@]+:\d+@[0-9a-f]{8,}):[0-9a-f]{32}$")
_RELEASE_IF = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)

_published: dict[str, str] = {}  # "name" -> this process's name, once it publishes


def worker_name() -> str:
    """This process's name as a holder of work: the published name in a worker that
    publishes its presence, else `<host>:<pid>` (a shell, a test, the web)."""
    return _published.get("name") or f"{socket.gethostname()}:{os.getpid()}"


def publishing_name() -> str:
    """A fresh name for a worker process that will publish its presence."""
    return f"{socket.gethostname()}:{os.getpid()}@{secrets.token_hex(6)}"


def _presence_tracked(name: str) -> bool:
    """Does the holder of this name publish its presence (only then can it be found gone)?"""
    return "@" in name


class WorkerPresence:
    """The beats of one worker process: start() before the first job, stop() at exit."""

    def __init__(self, name: str, connection: redis.Redis | None = None) -> None:
        self.name = name
        self.connection = connection or engine_redis()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.connection.set(_ALIVE + self.name, b"1", ex=PRESENCE_TTL_SECONDS)

    def start(self) -> None:
        self.beat()  # present before the first job is taken
        _published["name"] = self.name

        def run() -> None:
            while not self._stop.wait(PRESENCE_BEAT_SECONDS):
                try:
                    self.beat()
                except redis.RedisError:  # Redis away: the next beat tries again
                    log.warning("could not publish the presence of %s", self.name)

        self._thread = threading.Thread(target=run, name="airlock-presence", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """A clean exit holds no work: the key goes at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PRESENCE_BEAT_SECONDS + 1)
        try:
            self.connection.delete(_ALIVE + self.name)
        except redis.RedisError:
            log.warning("could not withdraw the presence of %s", self.name)


def workers_gone(names: Collection[str], connection: redis.Redis | None = None) -> set[str]:
    """Those of `names` that publish their presence and are gone (see the module
    docstring: a missing key is confirmed, or was confirmed before)."""
    tracked = sorted({name for name in names if _presence_tracked(name)})
    if not tracked:
        return set()
    conn = connection or engine_redis()
    missing = _missing(conn, tracked)
    if not missing:
        return set()
    known = {
        name
        for name, raw in zip(missing, conn.mget([_GONE + n for n in missing]), strict=True)  # type: ignore[arg-type]  # sync client
        if raw is not None
    }
    unsure = [name for name in missing if name not in known]
    if unsure:
        time.sleep(CONFIRM_AFTER_SECONDS)
        confirmed = _missing(conn, unsure)
        if confirmed:
            pipe = conn.pipeline(transaction=False)
            for name in confirmed:
                pipe.set(_GONE + name, b"1", ex=GONE_MEMORY_SECONDS)
            pipe.execute()
            log.warning("workers gone (no presence for %ss): %s", PRESENCE_TTL_SECONDS, confirmed)
        known |= set(confirmed)
    return known


def _missing(conn: redis.Redis, names: list[str]) -> list[str]:
    found: list[object] = list(conn.mget([_ALIVE + n for n in names]))  # type: ignore[arg-type]  # sync client
    return [name for name, raw in zip(names, found, strict=True) if raw is None]


def release_lock_of_gone_worker(lock: FencedLock, *, token: str | None = None) -> bool:
    """The resource's lock is busy (held under `token`, read now if not given): if its
    holder is a worker that is gone, delete the lock (only while it still holds that
    token) so that the caller may take it now rather than after its TTL. True when it
    was deleted."""
    token = token if token is not None else lock.holder_token()
    match = _WORKER_IN_TOKEN.search(token or "")
    if token is None or match is None or not workers_gone([match.group(1)], lock.redis):
        return False
    released = bool(lock.redis.eval(_RELEASE_IF, 1, lock.redis_key, token))
    if released:
        log.warning("took over %s from gone worker %s", lock.key, match.group(1))
    return released


def acquire_taking_over(lock: FencedLock, *, wait_seconds: float) -> int:
    """FencedLock.acquire; a lock held by a gone worker is taken over (see above).
    Raises LockBusy when a live holder keeps it."""
    try:
        return lock.acquire(wait_seconds=wait_seconds)
    except LockBusy:
        if not release_lock_of_gone_worker(lock):
            raise
    return lock.acquire(wait_seconds=wait_seconds)
