"""A web process whose database sockets are numbered above 1023 keeps lending its pooled
connections (console/pgbackend): the loan's liveness check takes any descriptor, and a
lent connection goes back to the pool whatever interrupts the check. Before, the check's
select() raised ValueError for such a descriptor, the error escaped, the connection was
never returned, and each such loan was a 500 until the pool was gone and every request
waited for a 503. Real PostgreSQL, the Procfile's own `web` line, real held polls."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from tests.conftest import free_port, test_database_url
from tests.deployload import (
    ProcfileProcess,
    default_environment,
    script_json,
    seed_poll_target,
    start_procfile_web,
)

HELD_POLLS = 1100  # past FD_SETSIZE (1024) on one web process
BURST = 60  # concurrent ordinary requests: the pool (20) grows, on new descriptors
ROUNDS = 3

# A process that holds 1,100 descriptors (as a web process holding that many long-polls
# does) before its pool opens: every pooled connection's socket is numbered above 1023.
_HIGH_DESCRIPTORS = """
import json, os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < 4096:
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096 if hard == resource.RLIM_INFINITY
                                                else min(4096, hard), hard))
null = os.open(os.devnull, os.O_RDONLY)
held = [os.dup(null) for _ in range(1100)]

import console.asgi  # a web process: its connections are pooled
from django.db import connection

answers, descriptors = [], []
for _ in range(3):
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            descriptors.append(connection.connection.fileno())
            answers.append(cursor.fetchone()[0])
    except Exception as error:
        answers.append(type(error).__name__ + ": " + str(error)[:80])
    finally:
        connection.close()
stats = connection.pool.get_stats()
print(json.dumps({
    "answers": answers,
    "descriptors": descriptors,
    "available": stats.get("pool_available", 0),
    "size": stats.get("pool_size", 0),
}))
"""


@pytest.mark.django_db
def test_a_pooled_connection_on_a_descriptor_above_1023_is_lent_and_returned() -> None:
    url = test_database_url()
    environment = default_environment(
        DATABASE_URL=url,
        AIRLOCK_DB_POOL_MAX="1",
        AIRLOCK_DB_POOL_MIN="1",
        AIRLOCK_DB_POOL_TIMEOUT="1",
    )
    seen = script_json(_HIGH_DESCRIPTORS, environment=environment)
    # Three loans of the pool's one connection, each answered: the check took the
    # descriptor (select() refused it: ValueError, then the lost connection's
    # PoolTimeout for every later loan), and every loan ended back in the pool.
    assert seen["answers"] == [1, 1, 1], seen
    assert len(seen["descriptors"]) == 3 and min(seen["descriptors"]) >= 1024, seen
    assert seen["size"] == 1 and seen["available"] == 1, seen


def _raise_descriptor_limit(at_least: int) -> None:
    """This process and the web process it starts may hold `at_least` descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= at_least:
        return
    if hard != resource.RLIM_INFINITY and hard < at_least:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {at_least}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (at_least, hard))


@contextlib.contextmanager
def held_polls(web: ProcfileProcess, path: str, token: str, count: int) -> Iterator[None]:
    """`count` long-polls (`Prefer: wait=60`) of `path`, each on a connection of its own,
    held by the web process (its own gauge says so) while the block runs."""
    port = int(web.url.rsplit(":", 1)[1])
    request = (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        "Prefer: wait=60\r\n\r\n"
    ).encode()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(request)
            sockets.append(sock)
        deadline = time.monotonic() + 60
        while _held(web) < count:
            assert time.monotonic() < deadline, f"held {_held(web)} of {count} polls"
            time.sleep(0.1)
        yield
    finally:
        for sock in sockets:
            sock.close()


def _held(web: ProcfileProcess) -> int:
    found = re.search(r"^airlock_longpoll_held (\d+)$", httpx.get(f"{web.url}/metrics").text, re.M)
    return int(found.group(1)) if found else 0


def _burst(url: str, token: str, count: int) -> Counter[int]:
    """`count` requests at once, each its own client; their statuses."""
    statuses: Counter[int] = Counter()
    lock = threading.Lock()

    def one() -> None:
        try:
            status = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
            code = status.status_code
        except httpx.HTTPError:
            code = 0
        with lock:
            statuses[code] += 1

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return statuses


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_web_process_holding_1100_polls_serves_ordinary_requests_without_a_5xx(
    tmp_path: Path,
) -> None:
    _raise_descriptor_limit(HELD_POLLS + 2048)
    target = seed_poll_target(1)
    env = default_environment(
        DATABASE_URL=test_database_url(),
        REDIS_URL=settings.REDIS_URL,
        WEB_CONCURRENCY="1",  # every poll on the one process
        AIRLOCK_DATA_DIR=str(tmp_path / "data"),
    )
    web = start_procfile_web(env, free_port(), tmp_path / "web.log")
    statuses: Counter[int] = Counter()
    try:
        with held_polls(web, target.path, target.run_token, HELD_POLLS):
            # Ordinary requests through Django (the agent's action list: the read front
            # answers single reads only), many at once, so the pool opens connections now,
            # above descriptor 1023.
            for _ in range(ROUNDS):
                statuses += _burst(f"{web.url}/api/v1/actions", target.tokens[0], BURST)
            descriptors = _database_descriptors(web)
    finally:
        web.stop()
    log = web.output()
    assert statuses == Counter({200: BURST * ROUNDS}), f"{statuses}\n{log[-3000:]}"
    assert "filedescriptor out of range" not in log
    # The case under test happened: the pool lent connections numbered above 1023.
    assert max(descriptors, default=0) >= 1024, descriptors


def _database_descriptors(web: ProcfileProcess) -> list[int]:
    """The descriptors of the web processes' sockets connected to PostgreSQL's port."""
    port = int(settings.DATABASES["default"].get("PORT") or 5432)
    remote = f":{port:04X}"
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                columns = line.split()
                if columns[2].endswith(remote):
                    inodes.add(columns[9])
    found: list[int] = []
    for pid in web.pids():
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in inodes:
                        found.append(int(fd.name))
    return found
