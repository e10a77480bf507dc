"""The Procfile's web processes each listen on a socket of their own (console/serve.py), so a
burst of new connections is spread over them by the kernel instead of all being accepted by
whichever process woke first for one shared socket."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from django.conf import settings

from console.serve import listening_socket
from tests.conftest import ROOT, free_port, test_database_url
from tests.deployload import ProcfileProcess, default_environment, start_procfile_web

pytestmark = [pytest.mark.slow]

CONNECTIONS = 48
_PID = re.compile(r"pid=(\d+)")


def _ss(*filters: str) -> list[str]:
    done = subprocess.run(["ss", "-Htnp", *filters], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def _listening_pids(port: int) -> list[int]:
    """The process of each listening socket on `port` (one line per socket)."""
    return [int(m.group(1)) for line in _ss("-l", f"sport = :{port}") if (m := _PID.search(line))]


def _serving_pids(port: int) -> Counter[int]:
    """How many established connections to `port` each process holds (server side)."""
    lines = _ss("state", "established", f"sport = :{port}")
    return Counter(int(m.group(1)) for line in lines if (m := _PID.search(line)))


def _open_at_once(port: int, count: int) -> list[socket.socket]:
    """`count` connections opened back to back, each having sent a keep-alive request, so
    that every one of them was accepted by some process before we count."""
    clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    for client in clients:
        client.sendall(request)
    for client in clients:
        assert client.recv(4096).startswith(b"HTTP/1.1 200"), "every connection is answered"
    return clients


def _web(tmp_path: Path) -> tuple[ProcfileProcess, int]:
    env = default_environment(DATABASE_URL=test_database_url(), REDIS_URL=settings.REDIS_URL)
    env["AIRLOCK_DATA_DIR"] = str(tmp_path / "data")
    port = free_port()
    return start_procfile_web(env, port, tmp_path / "web.log"), port


@pytest.mark.django_db(transaction=True)
def test_each_web_process_listens_on_its_own_socket_and_a_burst_is_spread(
    tmp_path: Path,
) -> None:
    web, port = _web(tmp_path)
    clients: list[socket.socket] = []
    try:
        workers = web.pids() - {web.process.pid}
        listeners = _listening_pids(port)
        # Two sockets, one per worker (uvicorn's --workers: one socket, the parent's).
        assert len(listeners) == 2, listeners
        assert set(listeners) <= workers, (listeners, workers)
        clients = _open_at_once(port, CONNECTIONS)
        served = _serving_pids(port)
    finally:
        for client in clients:
            client.close()
        web.stop()
    assert sum(served.values()) == CONNECTIONS, served
    assert set(served) == set(listeners), served
    # Spread by hash: each process's share of 48 is binomial(48, 1/2); fewer than 8 of them
    # happens about once in 10⁶ runs. With one shared socket, a burst went to one process.
    assert min(served.values()) >= 8, served


@pytest.mark.django_db(transaction=True)
def test_a_killed_web_process_is_replaced_on_its_own_socket(tmp_path: Path) -> None:
    web, port = _web(tmp_path)
    try:
        first = set(_listening_pids(port))
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        now = first
        while time.monotonic() < deadline:
            now = set(_listening_pids(port))
            if len(now) == 2 and victim not in now:
                break
            time.sleep(0.2)
        assert len(now) == 2 and victim not in now, (first, now)
        clients = _open_at_once(port, 8)
        for client in clients:
            client.close()
    finally:
        web.stop()


def test_a_port_held_without_reuseport_stops_the_launcher_instead_of_looping(
    tmp_path: Path,
) -> None:
    """A worker that cannot bind exits as a startup failure: uvicorn's supervisor then stops,
    instead of restarting it forever."""
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen(1)
    try:
        env = default_environment(PORT=str(port), HOST="127.0.0.1")
        env["AIRLOCK_DATA_DIR"] = str(tmp_path / "data")
        done = subprocess.run(
            ["python", "-m", "console.serve", "--port", str(port), "--workers", "2"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        holder.close()
    assert done.returncode != 0
    assert "cannot listen on 127.0.0.1" in done.stderr, done.stderr[-2000:]


def test_listening_sockets_of_one_port_share_it() -> None:
    first = listening_socket("127.0.0.1", 0, 16)
    try:
        second = listening_socket("127.0.0.1", first.getsockname()[1], 16)
        second.close()
    finally:
        first.close()
