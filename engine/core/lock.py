"""Per-resource Redis lock: SET NX PX with a random token; Lua release and renew by token.

The lock only keeps honest holders from overlapping; it is not what makes a
write safe. A holder can be paused (GC, SIGSTOP, a slow disk) past the TTL and
wake up believing it still holds the lock. What makes the write safe is the
fencing token from PostgreSQL (`next_fence`), checked by the write barrier.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from redis import Redis

from console.tracing import traced
from engine.core.errors import LockBusy, LockLost
from engine.core.fence import next_fence

LOCK_NAMESPACE = "airlock:lock:"
log = logging.getLogger("airlock.lock")

# Both scripts act only if the key still holds our token.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


def lock_key(resource_identifier: str) -> str:
    """The Redis key of a resource's lock, e.g. `airlock:lock:notification-policy/prod-alerts`."""
    return f"{LOCK_NAMESPACE}{resource_identifier}"


class FencedLock:
    """A per-resource lock plus the fencing token issued when it was taken.

        lock = FencedLock(redis, key="kind/name", ttl_ms=30_000)
        fence = lock.acquire(wait_seconds=0.0)  # raises LockBusy; fence from next_fence()
        lock.renew()                             # raises LockLost if the lock is gone or not ours
        lock.release() -> bool                   # token-checked; False if it was no longer ours

    Usable as a context manager (acquire on enter with `wait_seconds`, release on exit).
    `start_heartbeat()` renews from a daemon thread; `check()` raises LockLost if a
    renewal failed — call it (or `renew()`) right before writing.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        key: str,
        ttl_ms: int,
        wait_seconds: float = 0.0,
        holder: str = "",
    ) -> None:
        if ttl_ms < 1:
            raise ValueError("ttl_ms must be positive")
        self.redis = redis
        self.key = key
        self.redis_key = lock_key(key)
        self.ttl_ms = ttl_ms
        self.wait_seconds = wait_seconds
        # `holder` names what the lock is taken for (readable by whoever finds it busy).
        self.token = f"{holder}:{secrets.token_hex(16)}" if holder else secrets.token_hex(16)
        self.fence: int | None = None
        self.lost = False
        self._release_script = redis.register_script(_RELEASE)
        self._renew_script = redis.register_script(_RENEW)
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        self._on_renew: list[Callable[[], None]] = []

    # -- taking and giving back ------------------------------------------------

    @traced("airlock.lock", result="airlock.lock.taken")
    def try_acquire(self) -> bool:
        return bool(self.redis.set(self.redis_key, self.token, nx=True, px=self.ttl_ms))

    def acquire(self, wait_seconds: float | None = None) -> int:
        """Take the lock (waiting up to `wait_seconds`) and return a fresh fence.

        The fence is drawn from PostgreSQL *after* the lock is held, so a later
        holder always has a larger fence than an earlier one. Raises LockBusy.
        """
        self.take(wait_seconds)
        try:
            self.fence = next_fence()
        except BaseException:
            self.release()
            raise
        # A pause between SET and nextval could let a successor take the lock
        # and a *smaller* fence; confirm we still hold it now that ours is drawn.
        try:
            self.renew()
        except LockLost as exc:
            raise LockBusy(
                f"{self.key} was taken by another worker while the fence was drawn",
                extra={"resource": self.key},
            ) from exc
        return self.fence

    def take(self, wait_seconds: float | None = None) -> None:
        """SET the lock (waiting up to `wait_seconds`) without drawing a fence: for a
        FencedLockGroup, which draws one fence for all its locks. Raises LockBusy."""
        wait = self.wait_seconds if wait_seconds is None else wait_seconds
        deadline = time.monotonic() + max(wait, 0.0)
        pause = 0.005
        while not self.try_acquire():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockBusy(
                    f"{self.key} is locked by another worker",
                    extra={"resource": self.key},
                )
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.1)
        self.lost = False

    def renew(self) -> None:
        """Extend the TTL; raises LockLost (and marks the lock lost) if it is not ours."""
        if not self._renew_script(keys=[self.redis_key], args=[self.token, self.ttl_ms]):
            self.lost = True
            raise LockLost(
                f"the lock on {self.key} expired or was taken by another worker",
                extra={"resource": self.key, "fence": self.fence},
            )

    def release(self) -> bool:
        """Delete the lock if it is still ours. False when it had expired or moved on."""
        self.stop_heartbeat()
        return bool(self._release_script(keys=[self.redis_key], args=[self.token]))

    def held(self) -> bool:
        return self.holder_token() == self.token

    def holder_token(self) -> str | None:
        """The token of whoever holds the lock now (None when free)."""
        value: Any = self.redis.get(self.redis_key)
        return None if value is None else bytes(value).decode()

    def check(self) -> None:
        """Raise LockLost if a heartbeat renewal failed, else renew once now."""
        if self.lost:
            raise LockLost(
                f"the lock on {self.key} was lost",
                extra={"resource": self.key, "fence": self.fence},
            )
        self.renew()

    # -- background renewal ------------------------------------------------------

    def on_renew(self, hook: Callable[[], None]) -> None:
        """Call `hook` (from the heartbeat thread) after each successful renewal, e.g.
        to extend the lease of the operation the holder is running. A failing hook
        is logged and never stops the heartbeat."""
        self._on_renew.append(hook)

    def start_heartbeat(self, interval_ms: int | None = None) -> None:
        """Renew every `interval_ms` (default a third of the TTL) until released or lost."""
        interval = (interval_ms or max(self.ttl_ms // 3, 1)) / 1000
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    self.renew()
                except LockLost:
                    return
                except Exception:  # Redis unreachable: the TTL decides; report lost.
                    self.lost = True
                    return
                for hook in list(self._on_renew):
                    try:
                        hook()
                    except Exception:
                        log.warning("lock %s: a renewal hook failed", self.key, exc_info=True)

        self._heartbeat = threading.Thread(target=beat, name=f"lock:{self.key}", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=1)
        self._heartbeat = None

    # -- context manager -----------------------------------------------------------

    def __enter__(self) -> FencedLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class FencedLockGroup:
    """Several per-resource locks held by one holder under ONE fence (a worker draining
    a batch of writes on distinct resources).

        group = FencedLockGroup(redis, [lead, *others])  # each already taken (take/try_acquire)
        fence = group.fence()       # raises LockBusy if the first lock was lost meanwhile
        group.locks                 # those still held: the others lost meanwhile are dropped
        group.start_heartbeat(); ...; group.release()

    One fence serves every lock: it is drawn after all of them are held, so it is larger
    than any fence an earlier holder of any of them drew, which is all the barrier needs
    (`last_fence < :fence`, per resource). Renewal, the confirmation after the fence and
    the release are one pipelined round trip each, whatever the number of locks.
    """

    def __init__(self, redis: Redis, locks: list[FencedLock]) -> None:
        self.redis = redis
        self.locks = list(locks)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @traced("airlock.lock.batch")
    def join(self, candidates: list[FencedLock]) -> None:
        """Try to take more locks, without waiting (one pipelined SET NX for all): those
        taken join the group, the busy ones are left out."""
        if not candidates:
            return
        pipe = self.redis.pipeline(transaction=False)
        for lock in candidates:
            pipe.set(lock.redis_key, lock.token, nx=True, px=lock.ttl_ms)
        try:
            answers = pipe.execute()
        except BaseException:
            self._release_all(candidates)  # token-checked: only those we did take
            raise
        self.locks += [lock for lock, took in zip(candidates, answers, strict=True) if took]

    def fence(self) -> int:
        """Draw the fence and keep the locks still ours after it was drawn (see
        FencedLock.acquire for why the confirmation comes after the draw)."""
        try:
            fence = next_fence()
            answers = self._renew_all()
        except BaseException:
            self.release()
            raise
        kept = [lock for lock, ours in zip(self.locks, answers, strict=True) if ours]
        if not kept or kept[0] is not self.locks[0]:
            self.release()
            first = self.locks[0].key
            raise LockBusy(
                f"{first} was taken by another worker while the fence was drawn",
                extra={"resource": first},
            )
        self._release_all([lock for lock in self.locks if lock not in kept])
        self.locks = kept
        for lock in kept:
            lock.fence = fence
        return fence

    def _renew_all(self) -> list[bool]:
        pipe = self.redis.pipeline(transaction=False)
        for lock in self.locks:
            lock._renew_script(keys=[lock.redis_key], args=[lock.token, lock.ttl_ms], client=pipe)
        return [bool(answer) for answer in pipe.execute()]

    def renew(self) -> None:
        """Renew every lock at once; a lock no longer ours is marked lost (not raised:
        each write checks its own lock's `lost`)."""
        for lock, ours in zip(self.locks, self._renew_all(), strict=True):
            if not ours:
                lock.lost = True

    def start_heartbeat(self) -> None:
        """One thread renews every lock a third of the TTL apart until released."""
        interval = max(min(lock.ttl_ms for lock in self.locks) // 3, 1) / 1000
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    self.renew()
                except Exception:  # Redis unreachable: the TTL decides; report all lost.
                    for lock in self.locks:
                        lock.lost = True
                    return

        self._heartbeat = threading.Thread(target=beat, name="lock-group", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=1)
            self._heartbeat = None
        self._release_all(self.locks)

    def _release_all(self, locks: list[FencedLock]) -> None:
        if not locks:
            return
        pipe = self.redis.pipeline(transaction=False)
        for lock in locks:
            lock._release_script(keys=[lock.redis_key], args=[lock.token], client=pipe)
        pipe.execute()
