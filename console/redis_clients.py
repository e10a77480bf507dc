"""One pooled Redis client per (URL, timeout) for the life of the process.

Why a registry that never lets a client go, and not a module global swapped when
``settings.REDIS_URL`` changes: redis-py's ``Redis.__del__`` disconnects the
client's pool, and a ``Pipeline`` holds the pool but not the client. Replacing a
cached client while another thread had a pipeline from it in flight dropped the
client's last reference, closed the connection under the pipeline and raised
``AttributeError`` (not a ``RedisError``) out of ``execute()``: a 500 on one of
twenty concurrent writes. A process sees a handful of URLs (tests point it at a
private server), so keeping every client costs a few idle pools.
"""

from __future__ import annotations

import threading

import redis

_clients: dict[tuple[str, float | None], redis.Redis] = {}
_clients_lock = threading.Lock()


def shared_redis(url: str, *, timeout: float | None = None) -> redis.Redis:
    """The process's client for `url`; `timeout` bounds connecting and each reply."""
    key = (url, timeout)
    client = _clients.get(key)
    if client is not None:
        return client
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout
            )
            _clients[key] = client
        return client
