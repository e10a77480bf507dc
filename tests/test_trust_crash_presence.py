"""Worker presence (approvals/services/worker_presence.py): what makes a dead worker's work
resumable within seconds — and what keeps a live worker's work from being taken from it.
Real Redis (a private server), real locks."""

from __future__ import annotations

import time
from typing import Any

import pytest

from approvals.services.worker_presence import (
    CONFIRM_AFTER_SECONDS,
    WorkerPresence,
    acquire_taking_over,
    publishing_name,
    release_lock_of_gone_worker,
    workers_gone,
)
from engine.core.errors import LockBusy
from engine.core.lock import FencedLock

pytestmark = pytest.mark.django_db(transaction=True)  # a lock draws its fence from PostgreSQL


def test_a_worker_without_presence_is_gone_once_confirmed_and_then_at_once(
    engine_redis: Any,
) -> None:
    dead = publishing_name()  # a name no process beats for
    started = time.monotonic()
    assert workers_gone([dead]) == {dead}
    assert time.monotonic() - started >= CONFIRM_AFTER_SECONDS  # looked at twice
    started = time.monotonic()
    assert workers_gone([dead]) == {dead}
    assert time.monotonic() - started < 1  # remembered
    # A holder that never published its presence (a shell, a test, an old worker) is never
    # found gone: its work waits for its lease, as before.
    assert workers_gone(["somehost:1234"]) == set()


def test_a_live_worker_whose_key_redis_lost_is_not_taken_for_dead(engine_redis: Any) -> None:
    presence = WorkerPresence(publishing_name())
    presence.start()
    try:
        assert workers_gone([presence.name]) == set()
        engine_redis.client().flushall()  # every presence key gone at once
        assert workers_gone([presence.name]) == set()  # its next beat is back in time
    finally:
        presence.stop()
    assert engine_redis.client().exists(f"airlock:worker:alive:{presence.name}") == 0


def test_a_gone_workers_lock_is_taken_over_and_a_live_ones_is_not(engine_redis: Any) -> None:
    redis = engine_redis.client()
    live = WorkerPresence(publishing_name())
    live.start()
    try:
        held_by_live = FencedLock(redis, key="cfg/live", ttl_ms=30_000, holder=live.name)
        held_by_live.acquire()
        mine = FencedLock(redis, key="cfg/live", ttl_ms=30_000, holder=publishing_name())
        with pytest.raises(LockBusy):
            acquire_taking_over(mine, wait_seconds=0.05)
        assert held_by_live.held()
    finally:
        live.stop()

    dead = publishing_name()
    # A batch's companion lock names its action first, then the worker.
    held_by_dead = FencedLock(redis, key="cfg/dead", ttl_ms=30_000, holder=f"a1b2:{dead}")
    held_by_dead.acquire()
    mine = FencedLock(redis, key="cfg/dead", ttl_ms=30_000, holder=publishing_name())
    fence = acquire_taking_over(mine, wait_seconds=0.05)
    assert mine.held() and fence > (held_by_dead.fence or 0)

    untracked = FencedLock(redis, key="cfg/old", ttl_ms=30_000)  # a token with no worker
    untracked.acquire()
    assert release_lock_of_gone_worker(FencedLock(redis, key="cfg/old", ttl_ms=30_000)) is False
    assert untracked.held()
