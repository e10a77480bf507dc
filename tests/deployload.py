"""Load the product the way it is deployed: the Procfile's own `web` line, default settings,
driven by `wrk` (a compiled load generator, not a Python loop sharing the cores).

    web = start_procfile_web(database_url=..., redis_url=...)
    result = run_wrk(f"{web.url}/api/v1/actions/{action_id}", tokens, clients=128, seconds=6)
    result.statuses      # {200: 4321}
    result.failures      # [(503, wall-clock seconds), ...] every answer >= 500
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
WRK_SCRIPT = Path(__file__).resolve().parent / "wrk_statuses.lua"

# Settings a test's own environment may carry (tests/fixtures set some): a default deployment
# sets none of them, so none reaches the processes under test.
_NOT_DEFAULT = re.compile(r"^(AIRLOCK_|DJANGO_|CONN_MAX_AGE$|WEB_CONCURRENCY$|DEBUG$|LOG_LEVEL$)")


def procfile_command(name: str) -> str:
    """The command of one Procfile entry, exactly as written."""
    for raw in (ROOT / "Procfile").read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_-]+):\s*(.+)", raw.strip())
        if match and match.group(1) == name:
            return match.group(2)
    raise AssertionError(f"no {name!r} line in the Procfile")


def default_environment(**values: str) -> dict[str, str]:
    """The test's environment minus every Airlock/Django setting, plus `values`; the
    virtualenv's bin first on PATH (as `make run` does), so `uvicorn`/`python` are ours."""
    env = {key: value for key, value in os.environ.items() if not _NOT_DEFAULT.match(key)}
    for key in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "PYTHONPATH"):
        env.pop(key, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(values)
    return env


def script_json(code: str, *args: str, environment: dict[str, str]) -> dict[str, Any]:
    """Run `code` (`python -c`, with `args`) in a fresh process with `environment` and the
    project's settings; the JSON object its last line of output prints."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env={**environment, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "console.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@dataclass
class ProcfileProcess:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> set[int]:
        """This process and every descendant (uvicorn's worker processes)."""
        found = {self.process.pid}
        parents: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
        frontier = [self.process.pid]
        while frontier:
            children = parents.get(frontier.pop(), [])
            found.update(children)
            frontier.extend(children)
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)


def start_procfile(name: str, env: dict[str, str], log: Path) -> ProcfileProcess:
    """Start one Procfile line as a platform does: `bash -c "exec <line>"` in the project
    folder, in its own process group (stopped as a whole)."""
    process = subprocess.Popen(
        ["/bin/bash", "-c", f"exec {procfile_command(name)}"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return ProcfileProcess(name=name, process=process, log=log)


def start_procfile_web(env: dict[str, str], port: int, log: Path) -> ProcfileProcess:
    """The Procfile's `web` line on PORT/HOST, once it answers /healthz."""
    web = start_procfile("web", {**env, "PORT": str(port), "HOST": "127.0.0.1"}, log)
    web.url = f"http://127.0.0.1:{port}"
    wait_until_healthy(web, timeout=60)
    return web


def wait_until_healthy(web: ProcfileProcess, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    healthy = 0
    while healthy < 5:  # a few answers in a row: every uvicorn worker has started
        try:
            healthy = healthy + 1 if httpx.get(f"{web.url}/healthz").status_code == 200 else 0
        except httpx.HTTPError:
            healthy = 0
        if web.process.poll() is not None:
            raise AssertionError(f"the web process exited:\n{web.output()}")
        if time.monotonic() > deadline:
            web.stop()
            raise AssertionError(f"the web process never answered /healthz:\n{web.output()}")
        time.sleep(0.1)


def wrk_binary() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise AssertionError("wrk is not installed: scripts/test.sh installs it (apt-get)")
    return found


@dataclass
class WrkResult:
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[tuple[int, float]] = field(default_factory=list)
    answered_per_100ms: Counter[float] = field(default_factory=Counter)
    socket_errors: dict[str, int] = field(default_factory=dict)
    output: str = ""

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)

    def answered_between(self, start: float, end: float) -> int:
        return sum(n for at, n in self.answered_per_100ms.items() if start <= at < end)

    def first_answer_after(self, start: float) -> float:
        """When the first answer after `start` came (to 100 ms), +inf if none did."""
        return min((at for at in self.answered_per_100ms if at >= start), default=float("inf"))

    def failures_after(self, start: float) -> list[tuple[int, float]]:
        return [(status, at) for status, at in self.failures if at >= start]


def run_wrk(url: str, tokens: list[str], *, clients: int, seconds: int) -> WrkResult:
    """`clients` keep-alive connections polling `url` for `seconds`, each request with the
    next token in turn. Requests wait up to 30 s for an answer (a slow answer is an answer;
    only a status >= 500 or a socket error is a failure)."""
    command = [
        wrk_binary(),
        "--threads",
        "2",
        "--connections",
        str(clients),
        "--duration",
        f"{seconds}s",
        "--timeout",
        "30s",
        "--script",
        str(WRK_SCRIPT),
        url,
        "--",
        *tokens,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    assert done.returncode == 0, done.stdout + done.stderr
    return parse_wrk(done.stdout)


def parse_wrk(output: str) -> WrkResult:
    result = WrkResult(output=output)
    for line in output.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "STATUS":
            result.statuses[int(words[1])] += int(words[2])
        elif words[0] == "FAILURE":
            status, at_ms = words[1].split("@")
            result.failures.append((int(status), int(at_ms) / 1000))
        elif words[0] == "BUCKET":
            result.answered_per_100ms[int(words[1]) / 10] += int(words[2])
        elif words[0] == "ERRORS":
            # (wrk's own "status" count is every answer >= 400: counted above instead)
            result.socket_errors = {
                key: int(value)
                for key, value in (word.split("=") for word in words[1:])
                if key != "status"
            }
    assert result.socket_errors, f"wrk printed no summary:\n{output}"
    return result


def summary(result: WrkResult) -> str:
    statuses = ", ".join(f"{status}: {n}" for status, n in sorted(result.statuses.items()))
    return f"{result.total} answers ({statuses}); socket errors {result.socket_errors}"


@dataclass
class PollTarget:
    path: str  # the polled action's API path
    tokens: list[str]  # agent tokens, never used yet
    run_token: str  # an active run whose write set covers dns-record/load-*


def seed_poll_target(token_count: int) -> PollTarget:
    """An agent with `token_count` live tokens, an active run and one queued action of its
    own. The tokens were never used, so the first poll with each records its last use (the
    one write on the poll path)."""
    from approvals.services.tokens import agent_token_create
    from audit.services import Actor
    from tests.fixtures.api import make_active_run, make_agent_with_token
    from tests.fixtures.core import make_action

    agent = make_agent_with_token("load-bot")
    run = make_active_run(
        agent.agent,
        [{"resource": "dns-record/load-*", "operations": ["create", "update", "delete"]}],
    )
    action = make_action(
        run=run.run, identifier="dns-record/load-0", operation="create", payload={"n": 0}
    )
    tokens = [agent.token]
    while len(tokens) < token_count:
        _, secret = agent_token_create(agent=agent.agent, actor=Actor.system("tests"))
        tokens.append(secret)
    return PollTarget(path=f"/api/v1/actions/{action.pk}", tokens=tokens, run_token=run.token)


def seed_in_subprocess(env: dict[str, str], token_count: int, *, migrate: bool) -> PollTarget:
    """seed_poll_target in a Django process of `env`'s database (after `migrate` and the
    reference rows when asked), for databases other than the test run's own."""
    script = (
        "import dataclasses, json, django; django.setup()\n"
        "from django.core.management import call_command\n"
        "from console.reference import ensure_reference_data\n"
        "from tests.deployload import seed_poll_target\n"
        f"if {migrate}: call_command('migrate', interactive=False, verbosity=0)\n"
        "ensure_reference_data()\n"
        f"print(json.dumps(dataclasses.asdict(seed_poll_target({token_count}))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**env, "DJANGO_SETTINGS_MODULE": "console.settings", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return PollTarget(**json.loads(done.stdout.strip().splitlines()[-1]))


class ConnectionSampler:
    """Samples, every 50 ms while running, how many sessions the given processes hold on
    the PostgreSQL server (matched by the client port each backend reports, against the
    sockets those processes own): the peak is what the deployment really used."""

    def __init__(self, dsn: str, owner: ProcfileProcess) -> None:
        self.dsn = dsn
        self.owner = owner
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                ports = local_ports_of(self.owner.pids())
                rows = conn.execute(
                    "SELECT client_port FROM pg_stat_activity "
                    "WHERE backend_type = 'client backend' AND client_port IS NOT NULL"
                ).fetchall()
                held = sum(1 for (port,) in rows if port in ports)
                self.peak = max(self.peak, held)
                self.samples += 1
                self._stop.wait(0.05)


def local_ports_of(pids: set[int]) -> set[int]:
    """The local TCP ports of every socket the processes hold open."""
    inodes: set[str] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                columns = line.split()
                if columns[9] in inodes:
                    ports.add(int(columns[1].rsplit(":", 1)[1], 16))
    return ports
