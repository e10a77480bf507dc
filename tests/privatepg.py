"""A PostgreSQL server of the test's own (initdb into a temporary folder, a free port, trust
auth), so a test may stop and restart it under load without touching the shared server.

    server = PrivatePostgres()
    server.start()
    server.url("airlock")   # postgres://postgres@127.0.0.1:PORT/airlock
    server.restart()        # returns the wall-clock time it first answered again
    server.destroy()

Like tests/conftest.py's PrivateRedis. PostgreSQL refuses to run as root: as root, the
server runs as the `postgres` user (or `nobody`), which owns the temporary folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from tests.conftest import free_port


def postgres_bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise RuntimeError("no initdb: install the PostgreSQL server package")
    return Path(initdb).parent


def _version(path: str) -> int:
    with contextlib.suppress(ValueError):
        return int(Path(path).parent.parent.name)
    return 0


def _run_as() -> list[str]:
    if os.geteuid() != 0:
        return []
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return ["runuser", "-u", name, "--"]
    raise RuntimeError("running as root with neither a postgres nor a nobody user")


class PrivatePostgres:
    def __init__(self, *, max_connections: int = 100) -> None:
        self.bindir = postgres_bindir()
        self.port = free_port()
        self.max_connections = max_connections
        self.folder = Path(tempfile.mkdtemp(prefix="airlock-pg-"))
        self.datadir = self.folder / "data"
        self.logfile = self.folder / "postgres.log"
        self.prefix = _run_as()
        if self.prefix:
            user = pwd.getpwnam(self.prefix[2])
            os.chown(self.folder, user.pw_uid, user.pw_gid)

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [*self.prefix, str(self.bindir / "pg_ctl"), "-D", str(self.datadir), *args],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def start(self) -> None:
        if not self.datadir.exists():
            subprocess.run(
                [
                    *self.prefix,
                    str(self.bindir / "initdb"),
                    "-D",
                    str(self.datadir),
                    "--username=postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-sync",
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )
        self._pg_ctl("start", "-w", "-l", str(self.logfile), "-o", self._options())
        self.wait_until_answering(timeout=30)

    def stop(self) -> None:
        """A fast shutdown: every session is cut, open transactions roll back."""
        self._pg_ctl("stop", "-w", "-m", "fast")

    def restart(self, *, downtime: float = 0.0) -> float:
        """Stop, stay down `downtime` seconds, start; the wall-clock time (time.time())
        it first answered again."""
        self.stop()
        time.sleep(downtime)
        self._pg_ctl("start", "-w", "-l", str(self.logfile), "-o", self._options())
        return self.wait_until_answering(timeout=30)

    def _options(self) -> str:
        # fsync off: a fast shutdown still writes everything; only a crash could lose data.
        return (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 "
            f"-c max_connections={self.max_connections} -c fsync=off "
            "-c shared_buffers=16MB"
        )

    def wait_until_answering(self, *, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            attempt = time.time()
            try:
                with psycopg.connect(self.url(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return attempt
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            self._pg_ctl("stop", "-w", "-m", "immediate")
        shutil.rmtree(self.folder, ignore_errors=True)
