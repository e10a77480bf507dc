"""Per-resource Redis lock: SET NX PX with a random token; Lua release and renew by token."""

from __future__ import annotations

from redis import Redis


class FencedLock:
    """Owner: core helper. Interface contract:

    lock = FencedLock(redis, key="kind/name", ttl_ms=30_000)
    fence = lock.acquire(wait_seconds=0.0)  # raises LockBusy; fence from next_fence()
    lock.renew()                             # raises LockLost if the lock is gone or not ours
    lock.release() -> bool                   # token-checked; False if it was no longer ours
    lock.fence, lock.token, lock.key
    Usable as a context manager (acquire on enter, release on exit).
    """

    def __init__(self, redis: Redis, *, key: str, ttl_ms: int) -> None:
        raise NotImplementedError
