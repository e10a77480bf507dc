"""In-process measurements that need Django, each run in its own process:

    python -m bench.measure @spec.json  → prints one JSON result

- `core_write`: the core path (fenced lock + fence + operation + barrier write + version row +
  audit, one transaction) against a bare `UPDATE … WHERE version = …`, interleaved one for one
  so drift on a shared machine hits both alike.
- `audit_append`: appends for a bounded time (several processes run it at once), with the
  commit floor (a bare INSERT + COMMIT loop, alone and behind one shared row) and a round trip
  that writes nothing (SELECT) beside it.
- `seed_scale`: bulk data for the scale figures (COPY), with a valid audit chain.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup()  # the app registry must be ready before the models below are imported

import redis  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection, connections  # noqa: E402

from approvals.models import Action, ActionStatus, PayloadFormat, Run  # noqa: E402
from audit.models import AuditEvent  # noqa: E402
from audit.services import Actor, audit_append  # noqa: E402
from bench import seed  # noqa: E402
from console.advisory_locks import AUDIT_HEAD_QUEUE  # noqa: E402
from engine.core.barrier import apply_action  # noqa: E402
from engine.core.lock import FencedLock  # noqa: E402
from engine.core.operations import open_operation  # noqa: E402
from ownership.models import Resource  # noqa: E402


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def core_write(spec: dict[str, Any]) -> dict[str, Any]:
    run = Run.objects.select_related("agent").get(pk=spec["run_id"])
    target = Resource.objects.get(pk=spec["core_resource_id"])
    bare = Resource.objects.get(pk=spec["bare_resource_id"])
    client = redis.Redis.from_url(settings.REDIS_URL)
    actor = Actor.run(run)
    n = int(spec["n"])
    deadline = time.perf_counter() + float(spec.get("max_seconds", 60))
    core_times: list[float] = []
    bare_times: list[float] = []
    refused = 0
    for i in range(n):
        if time.perf_counter() > deadline:
            break
        target.refresh_from_db(fields=["version"])
        # The core path's input row, not measured; proposing it through the service would
        # enqueue a job that races the measured write (the barrier writes the audit it measures).
        action = Action.objects.create(
            run=run,
            agent=run.agent,
            kind_id=target.kind_id,
            name=target.name,
            resource=target,
            operation="update",
            payload_format=PayloadFormat.MERGE_PATCH,
            payload={"n": i},
            observed_version=target.version,
            conflict_class_id=spec["conflict_class"],
            status=ActionStatus.QUEUED,
        )
        # --- the core path
        t0 = time.perf_counter()
        lock = FencedLock(client, key=f"{target.kind_id}/{target.name}", ttl_ms=30_000)
        fence = lock.acquire(wait_seconds=1.0)
        try:
            operation = open_operation(
                action_id=action.pk, fence=fence, worker="bench", lease_seconds=60
            )
            outcome = apply_action(
                action_id=action.pk, operation_id=operation.pk, fence=fence, actor=actor
            )
        finally:
            lock.release()
        core_times.append(time.perf_counter() - t0)
        if not outcome.applied:
            refused += 1
        # --- the bare baseline: one conditional single-row UPDATE, autocommit
        t0 = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE ownership_resource SET document = %s, version = version + 1 "
                "WHERE id = %s AND version = %s",
                [json.dumps({"n": i}), bare.pk, bare.version],
            )
            assert cursor.rowcount == 1
        bare.version += 1
        bare_times.append(time.perf_counter() - t0)
    core_p50 = _pct(core_times, 0.5)
    bare_p50 = _pct(bare_times, 0.5)
    return {
        "writes": len(core_times),
        "refused": refused,
        "core_write_p50_ms": _ms(core_p50),
        "core_write_p99_ms": _ms(_pct(core_times, 0.99)),
        "bare_update_p50_ms": _ms(bare_p50),
        "bare_update_p99_ms": _ms(_pct(bare_times, 0.99)),
        "core_write_vs_bare_update": (
            round(core_p50 / bare_p50, 2) if core_p50 and bare_p50 else None
        ),
    }


class _Floor(NamedTuple):
    """A loop measured beside the appends: its statement, the result key of its median rate,
    and the share of the append window it runs."""

    sql: str
    result_key: str
    window_share: float = 1.0


# The commit floor: what one commit per event costs on this machine without any chain. `bare`
# inserts a row per commit (independent writers: PostgreSQL's group commit shares fsyncs);
# `serialised` also moves one shared row as the head is moved (queued on an advisory lock
# first, then the row), so its lock is held through each commit's flush and writers go one
# behind the other, as appends do.
_FLOOR_QUEUE = (AUDIT_HEAD_QUEUE, 2)  # the head's namespace; key 1 is the real head's queue
_FLOORS = {
    "bare": _Floor(
        "INSERT INTO bench_commit_floor (n, details) VALUES (%s, %s::jsonb)",
        "bare_commit_floor_per_s",
    ),
    "serialised": _Floor(
        f"WITH queued AS MATERIALIZED (SELECT pg_advisory_xact_lock{_FLOOR_QUEUE}), "  # noqa: S608
        "head AS (UPDATE bench_commit_floor_head SET n = n + 1 "
        "WHERE id = 1 AND EXISTS (SELECT FROM queued) RETURNING n) "
        "INSERT INTO bench_commit_floor (n, details) SELECT head.n + 0 * %s, %s::jsonb FROM head",
        "serialised_commit_floor_per_s",
    ),
    # One round trip that writes nothing and so flushes no WAL: what a writer that sends one
    # statement an event and waits for its answer cannot exceed, whatever the statement. It
    # barely moves between windows: a third of the time is enough, and keeps the default
    # bench under its 15 minutes.
    "round_trip": _Floor("SELECT %s::bigint, %s::jsonb", "round_trip_floor_per_s", 1 / 3),
}


def _floor_tables() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS bench_commit_floor "
            "(id bigserial PRIMARY KEY, n bigint NOT NULL, details jsonb NOT NULL)"
        )
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS bench_commit_floor_head (id int PRIMARY KEY, n bigint)"
        )
        cursor.execute("INSERT INTO bench_commit_floor_head VALUES (1, 0) ON CONFLICT DO NOTHING")


def _backend_cpu_seconds() -> float | None:
    """CPU time of this connection's PostgreSQL backend so far (user + system), read from
    /proc: None where the server is not a local process this user may read."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        row = cursor.fetchone()
    try:
        with open(f"/proc/{row[0]}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Writer(NamedTuple):
    """What one writer reports: its events, its time, and the CPU seconds it and its
    backend used meanwhile (None where the backend cannot be read)."""

    events: int
    elapsed: float
    cpu: float
    backend_cpu: float | None


def _append_for(kind: str, seconds: float, start: Any, results: Any) -> None:
    """One writer (a forked process with its own connection, autocommit: one event, one
    commit): append, or run the floor's statement, until time is up. Reports its count, its
    time, and the CPU it and its backend used meanwhile."""
    actor = Actor.system("bench")
    backend_cpu0 = _backend_cpu_seconds()
    start.wait()
    count = 0
    own_cpu0 = _own_cpu_seconds()
    t0 = time.perf_counter()
    if kind == "append":
        while time.perf_counter() - t0 < seconds:
            audit_append(event_type="bench.append", actor=actor, details={"n": count})
            count += 1
    else:
        with connection.cursor() as cursor:
            while time.perf_counter() - t0 < seconds:
                cursor.execute(_FLOORS[kind].sql, [count, json.dumps({"n": count})])
                count += 1
    elapsed, own_cpu = time.perf_counter() - t0, _own_cpu_seconds() - own_cpu0
    backend_cpu1 = _backend_cpu_seconds()
    backend_cpu = None
    if backend_cpu0 is not None and backend_cpu1 is not None:
        backend_cpu = backend_cpu1 - backend_cpu0
    results.put(_Writer(count, elapsed, own_cpu, backend_cpu))


@dataclass(frozen=True)
class _Round:
    per_s: float
    events: int
    writer_cpu: float  # seconds, all writers
    backend_cpu: float | None  # seconds, their backends (None: not readable here)


def _writers_round(kind: str, writers: int, seconds: float) -> _Round:
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(writers), context.Queue()
    connections.close_all()  # each child opens its own connection
    children = [
        context.Process(target=_append_for, args=(kind, seconds, start, results))
        for _ in range(writers)
    ]
    for child in children:
        child.start()
    done: list[_Writer] = [results.get(timeout=seconds + 120) for _ in children]
    for child in children:
        child.join(timeout=30)
    events = sum(writer.events for writer in done)
    backends = [writer.backend_cpu for writer in done if writer.backend_cpu is not None]
    return _Round(
        per_s=float(events / max(writer.elapsed for writer in done)),
        events=events,
        writer_cpu=sum(writer.cpu for writer in done),
        backend_cpu=sum(backends) if len(backends) == len(done) else None,
    )


def _cpu_per_event(rounds: list[_Round]) -> dict[str, Any]:
    """CPU an event costs (µs, writer's Python and its PostgreSQL backend, over every round)
    and the rate this machine's CPUs could reach at that cost with no waiting at all."""
    events = sum(r.events for r in rounds) or 1
    writer = sum(r.writer_cpu for r in rounds) / events
    backends = [r.backend_cpu for r in rounds if r.backend_cpu is not None]
    backend = sum(backends) / events if len(backends) == len(rounds) else None
    cpus = os.cpu_count() or 1
    return {
        "writer_cpu_us": round(writer * 1e6),
        "backend_cpu_us": None if backend is None else round(backend * 1e6),
        "cpu_ceiling_per_s": None if backend is None else round(cpus / (writer + backend)),
    }


def audit_writers(spec: dict[str, Any]) -> dict[str, Any]:
    """`writers` processes appending at once, forked from this one (one Django start-up) and
    released together by a barrier. Each append is its own transaction (autocommit), as a
    service's change and its event are one transaction. With `floor`, the same writers also
    run each of _FLOORS' loops, interleaved round by round with the appends; the figure
    is the median round, each floor beside it."""
    writers, seconds = int(spec["writers"]), float(spec["seconds"])
    kinds = ["append", *(_FLOORS if spec.get("floor") else [])]
    if len(kinds) > 1:
        _floor_tables()
    done: dict[str, list[_Round]] = {kind: [] for kind in kinds}
    for _ in range(int(spec.get("rounds", 1))):
        for kind in kinds:
            share = _FLOORS[kind].window_share if kind in _FLOORS else 1.0
            done[kind].append(_writers_round(kind, writers, seconds * share))
    rates = {kind: [r.per_s for r in rounds] for kind, rounds in done.items()}
    median = {kind: statistics.median(values) for kind, values in rates.items()}
    result: dict[str, Any] = {"writers": writers, "per_s": round(median["append"], 1)}
    result["rounds"] = {kind: [round(rate) for rate in values] for kind, values in rates.items()}
    # Where the ceiling is: with every CPU busy, no rate exceeds CPUs ÷ CPU per event.
    result["cpu"] = {kind: _cpu_per_event(rounds) for kind, rounds in done.items()}
    for kind in kinds[1:]:
        result[_FLOORS[kind].result_key] = round(median[kind], 1)
        result[f"vs_{kind}_floor"] = round(median["append"] / median[kind], 2)
    return result


def seed_scale(spec: dict[str, Any]) -> dict[str, Any]:
    """Bring the database up to the given totals (bench/seed.py); keep the audit chain valid."""
    t0 = time.perf_counter()
    checkpointed = seed.seed_scale(spec)
    return {
        "checkpointed": checkpointed,
        "audit_events": AuditEvent.objects.count(),
        "resources": Resource.objects.count(),
        "actions": Action.objects.count(),
        "seconds": round(time.perf_counter() - t0, 2),
    }


TASKS = {"core_write": core_write, "audit_append": audit_writers, "seed_scale": seed_scale}


def main(argv: list[str]) -> int:
    with open(argv[0].removeprefix("@")) as handle:
        spec: dict[str, Any] = json.load(handle)
    # {"tasks": [...]}: several tasks in one process (one Django start-up, not several).
    specs = spec.get("tasks", [spec])
    results = {s["task"]: TASKS[s["task"]](s) for s in specs}
    print(json.dumps(results if "tasks" in spec else results[spec["task"]], default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
