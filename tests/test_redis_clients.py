"""The process's shared Redis clients outlive a change of ``settings.REDIS_URL``.

CI at stop 27: one of twenty concurrent PATCHes answered 500. The rate limiter kept
one cached client and replaced it when the URL changed; the replaced client's
``__del__`` disconnected its pool under another thread's pipeline, whose
``execute()`` then raised ``AttributeError`` past the limiter's ``RedisError``
guard.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

import pytest
from django.conf import settings as django_settings

from approvals.outbox import engine_redis
from approvals.services.tokens import Principal
from console.api_support import rate_limit_writes
from console.redis_clients import shared_redis
from tests.conftest import PrivateRedis


def test_rate_limiter_survives_the_url_changing_under_concurrent_writers(
    settings: Any, private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    urls = [settings.REDIS_URL, private_redis.url]
    settings.REDIS_URL = urls[0]  # the fixture restores it; raw setattrs below go on top
    stop = threading.Event()
    failures: list[BaseException] = []
    calls: list[int] = []  # each writer's count, appended once (no shared += across threads)

    def write(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                rate_limit_writes(Principal(kind="agent", token_prefix=f"rc{worker}-{n}"))
            except BaseException as exc:  # any escape at all is the defect
                failures.append(exc)
        calls.append(n)

    def flip_url() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            django_settings.REDIS_URL = urls[i % 2]
            gc.collect(0)
            time.sleep(0.0005)

    with caplog.at_level(logging.WARNING, logger="airlock.api"):
        threads = [threading.Thread(target=write, args=(w,)) for w in range(8)]
        threads.append(threading.Thread(target=flip_url))
        for thread in threads:
            thread.start()
        time.sleep(3)
        stop.set()
        for thread in threads:
            thread.join(timeout=20)

    assert sum(calls) > 500, calls  # the collision was exercised, not skipped
    assert failures == [], failures[:3]
    unavailable = [r for r in caplog.records if "rate limiter unavailable" in r.getMessage()]
    assert unavailable == []


def test_engine_client_is_kept_whatever_other_urls_the_process_looks_up(settings: Any) -> None:
    first = engine_redis()
    # More URLs than the old per-URL cache held (eight): an evicting cache drops, and
    # so closes, a client that a pipeline in another thread may still be using.
    for n in range(12):
        shared_redis(f"redis://127.0.0.1:1/{n}")
    gc.collect()
    assert engine_redis() is first
    assert shared_redis(settings.REDIS_URL, timeout=1) is not first  # its own timeouts
    assert first.ping()


def test_the_engine_client_packs_and_parses_in_c() -> None:
    # hiredis (pyproject): every enqueue, publish, lock and rate-limit check packs its
    # commands and parses its answers in C; without it redis-py silently falls back to Python.
    from redis._parsers import _HiredisParser
    from redis.connection import HiredisRespSerializer

    client = engine_redis()
    assert client.ping()
    connection = client.connection_pool.get_connection()
    try:
        assert isinstance(connection._parser, _HiredisParser)
        assert isinstance(connection._command_packer, HiredisRespSerializer)
    finally:
        client.connection_pool.release(connection)
