"""One function per figure of issue 11's goal table. Each returns `{key: figure(...)}` entries
(bench.report.figure: the value with its goal beside it and the detail that explains it); the
scale figures are in bench/scale.py.

HTTP throughput comes from wrk; waiting agents and deciding people from bench.loadgen (an
asyncio process that waits, not load); in-process timings from bench.measure.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from django.db.models import Max, Min
from rq import Queue
from rq.job import Job

from approvals.models import Action, Operation
from audit.linker import audit_link, audit_unlinked
from audit.models import AuditEvent
from audit.verify import verify_chain
from bench import fixtures, recovery
from bench.fixtures import Pending, RunHandle, World
from bench.report import figure
from bench.sizes import Size
from bench.stack import PY, ROOT, Stack, log, raise_nofile
from ownership.models import Resource

# The Procfile's worker line, started twice (as `honcho start -c worker=2` would).
WORKERS = 2


@dataclass
class Bench:
    stack: Stack
    world: World
    size: Size
    main: RunHandle  # bench-wait/* and bench-call/*: long-polls, round trip, drain, poll
    core: RunHandle  # bench-core/*: the in-process core path and the scale figures
    poll_action: Pending

    def spec_file(self, spec: dict[str, Any]) -> str:
        """A spec as `@file`: thousands of action ids do not fit in argv."""
        path = self.stack.workdir / f"spec-{uuid.uuid4().hex}.json"
        path.write_text(json.dumps(spec))
        return f"@{path}"

    def run_json(self, module: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        done = subprocess.run(
            [PY, "-m", module, self.spec_file(spec)],
            cwd=ROOT,
            env=self.stack.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=raise_nofile,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{module} failed ({done.returncode}): {done.stderr[-1500:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def loadgen(self, spec: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        return self.run_json("bench.loadgen", {"host": "127.0.0.1", **spec}, timeout)

    def decision_items(self, pendings: list[Pending]) -> list[dict[str, str]]:
        """Actions with their approval and a deciding token (each within the rate limit)."""
        tokens = self.world.operator_tokens(len(pendings))
        return [
            {
                "id": p.action_id,
                "etag": p.etag,
                "approval": p.approval_id,
                "decider": tokens[i // fixtures.DECISIONS_PER_TOKEN],
            }
            for i, p in enumerate(pendings)
        ]


def rounded_median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _tag() -> str:
    return uuid.uuid4().hex[:6]


# --- long-polls ----------------------------------------------------------------------------


def longpoll(b: Bench) -> dict[str, Any]:
    """N polls held at once on the Procfile's web processes, then a sample of the actions'
    approvals decided; wake-up = decision acknowledged → that held poll answered."""
    names = [f"lp-{_tag()}-{i}" for i in range(b.size.longpoll)]
    pendings = fixtures.pending(b.main, "bench-wait", names)
    items = b.decision_items(pendings)
    spec = {"mode": "longpoll", "port": b.stack.web_port, "token": b.main.token}
    spec.update(items=items, wakes=b.size.longpoll_wakes, wait=60, settle=2.0)
    spec.update(change_concurrency=8)
    rss_before = b.stack.web_rss_kb()
    proc = subprocess.Popen(
        [PY, "-m", "bench.loadgen", b.spec_file({"host": "127.0.0.1", **spec})],
        cwd=ROOT,
        env=b.stack.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=raise_nofile,
    )
    peak = rss_before
    while proc.poll() is None:
        peak = max(peak, b.stack.web_rss_kb())
        time.sleep(0.25)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"longpoll waiters failed: {err[-1500:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["server_rss_mb"] = {"before": rss_before // 1024, "peak": peak // 1024}
    log(f"longpoll: held {result['held']}/{len(items)}, wake p99 {result['wake_p99_ms']} ms")
    held_note = "" if b.size.longpoll >= 2000 else f"size {b.size.name}: {len(items)} requested"
    return {
        "longpoll_held": figure(
            "longpoll_held",
            result["held"],
            errors=result["connect_errors"],
            requested=len(items),
            note=held_note,
            detail=result,
        ),
        "longpoll_wake_p99_ms": figure(
            "longpoll_wake_p99_ms",
            result["wake_p99_ms"],
            p50_ms=result["wake_p50_ms"],
            woken=result["woken"],
            held=result["held"],
        ),
    }


def round_trip(b: Bench) -> dict[str, Any]:
    """A person's decision sent → the waiting agent's long-poll answered with the new status,
    while `roundtrip_waiting` other agents keep waiting; each decision once the previous
    one's write is applied (bench/loadgen.py `run_roundtrip`), then as many back to back."""
    samples = b.size.roundtrip_samples
    total = b.size.roundtrip_waiting + 2 * samples
    names = [f"rt-{_tag()}-{i}" for i in range(total)]
    items = b.decision_items(fixtures.pending(b.main, "bench-wait", names))
    result = b.loadgen(
        {
            "mode": "roundtrip",
            "port": b.stack.web_port,
            "token": b.main.token,
            "items": items,
            "samples": samples,
            "back_to_back": samples,
            "wait": 60,
            "settle": 1.0,
            "bare": {
                "port": b.stack.bare_port,
                "path": f"/bench/bare/actions/{b.poll_action.action_id}",
                "token": b.main.token,
            },
        }
    )
    rushed = result["back_to_back"]
    decision, bare = result["decision_request_p50_ms"], result["bare_request_p50_ms"]
    log(
        f"round trip: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms "
        f"(back to back: {rushed['p50_ms']} / {rushed['p99_ms']} ms); decision request p50 "
        f"{decision} ms, bare token view p50 {bare} ms"
    )
    detail = {"waiting": b.size.roundtrip_waiting, "samples": result["samples"]}
    errors = result["missed"]
    return {
        "decision_request_vs_bare_p50": figure(
            "decision_request_vs_bare_p50",
            round(decision / bare, 2) if decision and bare else None,
            errors=errors,
            note=f"decision request p50 {decision} ms, bare token view p50 {bare} ms",
            decision_request_p50_ms=decision,
            decision_request_p99_ms=result["decision_request_p99_ms"],
            bare_request_p50_ms=bare,
        ),
        "approval_round_trip_p50_ms": figure(
            "approval_round_trip_p50_ms",
            result["p50_ms"],
            errors=errors,
            decision_request_p50_ms=result["decision_request_p50_ms"],
            note=f"back to back {rushed['p50_ms']}",
            **detail,
            detail=result,
        ),
        "approval_round_trip_p99_ms": figure(
            "approval_round_trip_p99_ms",
            result["p99_ms"],
            errors=errors,
            note=f"back to back {rushed['p99_ms']}",
            **detail,
        ),
    }


# --- the approved-write drain and its RQ ceiling ----------------------------------------------


def _span_rate(count: int, first: datetime | None, last: datetime | None) -> float | None:
    """Items per second from the first one's start to the last one's finish (worker start-up
    excluded; a batch's writes share one finish time, so the first start, not the first
    finish, opens the span)."""
    if first is None or last is None or count < 1 or last <= first:
        return None
    return round(count / (last - first).total_seconds(), 1)


def _enqueue_noops(queue: Queue, jobs: int) -> list[str]:
    datas = [Queue.prepare_data("bench.jobs.noop") for _ in range(jobs)]
    return [job.id for job in queue.enqueue_many(datas)]


def _noop_rate(connection: redis.Redis, ids: list[str]) -> float | None:
    jobs = [j for j in Job.fetch_many(ids, connection) if j and j.started_at and j.ended_at]
    first = min((j.started_at for j in jobs if j.started_at), default=None)
    return _span_rate(len(jobs), first, max((j.ended_at for j in jobs if j.ended_at), default=None))


def _wait_jobs(connection: redis.Redis, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = Job.fetch_many(ids, connection)
        if all(j is None or j.ended_at is not None for j in jobs):
            return
        time.sleep(0.1)


def _approve_and_queue(b: Bench, pendings: list[Pending]) -> dict[str, Any]:
    """With the workers stopped, one FIFO queue fills with no-op jobs, then the approved
    writes' jobs (each decision enqueues its action), then no-op jobs again: one worker start
    drains all three, so the ceiling brackets the drain on the same workers."""
    connection = redis.Redis.from_url(b.stack.redis_url)
    queue = Queue("default", connection=connection)
    before = _enqueue_noops(queue, b.size.noop_jobs)
    decided = b.loadgen(
        {
            "mode": "approve",
            "port": b.stack.web_port,
            "items": b.decision_items(pendings),
            "concurrency": 4,
        }
    )
    after = _enqueue_noops(queue, b.size.noop_jobs)
    ids = [p.action_id for p in pendings]
    b.stack.start_workers(WORKERS)
    finished = fixtures.wait_final(ids, timeout=60 + len(ids) * 0.1)
    _wait_jobs(connection, before + after, timeout=60)
    span = Operation.objects.filter(
        action_id__in=ids, status="done", undo_of__isnull=True
    ).aggregate(first=Min("started_at"), last=Max("finished_at"))
    applied = Action.objects.filter(id__in=ids, status="applied").count()
    return {
        "actions": len(ids),
        "applied": applied,
        "finished": finished,
        "rate": _span_rate(applied, span["first"], span["last"]),
        "noop_before": _noop_rate(connection, before),
        "noop_after": _noop_rate(connection, after),
        "approve_api": decided,
    }


def drain(b: Bench) -> dict[str, Any]:
    """Approved per-call updates of distinct resources, drained by the Procfile's workers, ÷
    the no-op job rate of the same workers just before and just after, in one queue."""
    names = [f"aw-{_tag()}-{i}" for i in range(b.size.approved)]
    fixtures.create_resources(b.main, "bench-call", names, {"touched": None})
    pendings = fixtures.pending(b.main, "bench-call", names, update=True)
    b.stack.stop("worker")
    try:
        result = _approve_and_queue(b, pendings)
    finally:
        if not b.stack.processes.get("worker"):
            b.stack.start_workers(WORKERS)
    ceilings = [r for r in (result["noop_before"], result["noop_after"]) if r]
    ceiling = round(statistics.mean(ceilings), 1) if ceilings else None
    rate = result["rate"]
    log(f"drain: {rate} approved writes/s, no-op jobs {ceilings} per s")
    unapplied = result["actions"] - result["applied"]
    return {
        "approved_writes_vs_noop_jobs": figure(
            "approved_writes_vs_noop_jobs",
            round(rate / ceiling, 2) if rate and ceiling else None,
            errors=unapplied,
            noop_jobs_per_s=ceiling,
            workers=WORKERS,
        ),
        "approved_writes_per_s": figure(
            "approved_writes_per_s", rate, errors=unapplied, detail=result
        ),
    }


# --- in-process figures -------------------------------------------------------------------


def _core_resources(b: Bench) -> tuple[int, int]:
    names = [f"core-{_tag()}", f"bare-{_tag()}"]
    fixtures.create_resources(b.core, "bench-core", names, {"n": 0})
    rows = Resource.objects.filter(kind_id="bench-core", name__in=names)
    ids = dict(rows.values_list("name", "id"))
    return ids[names[0]], ids[names[1]]


def core_spec(b: Bench, n: int) -> dict[str, Any]:
    core_id, bare_id = _core_resources(b)
    spec: dict[str, Any] = {"task": "core_write", "n": n, "run_id": str(b.core.run_id)}
    spec.update(core_resource_id=core_id, bare_resource_id=bare_id)
    spec.update(conflict_class="recompute_field", max_seconds=120)
    return spec


def core_write(b: Bench) -> dict[str, Any]:
    result = b.run_json("bench.measure", core_spec(b, b.size.core_n), 300)
    log(f"core write p50 {result['core_write_p50_ms']} ms, bare {result['bare_update_p50_ms']} ms")
    return {
        "core_write_vs_bare_update": figure(
            "core_write_vs_bare_update",
            result["core_write_vs_bare_update"],
            errors=result["refused"],
            detail=result,
        )
    }


def _audit_writers(b: Bench, writers: int) -> dict[str, Any]:
    """Appends/s by `writers` processes (one event per transaction), with the commit floor of
    the same writers measured in the same process, interleaved round by round."""
    rounds = 1 if b.size.name == "tiny" else 3
    spec = {"task": "audit_append", "writers": writers, "seconds": b.size.audit_seconds}
    spec.update(floor=True, rounds=rounds)
    timeout = 3 * rounds * b.size.audit_seconds + 180
    return b.run_json("bench.measure", spec, timeout)


def audit(b: Bench) -> dict[str, Any]:
    runs = {writers: _audit_writers(b, writers) for writers in b.size.audit_writers}
    rates = {writers: float(run["per_s"]) for writers, run in runs.items()}
    # Events commit unlinked and the Procfile's `audit` process links them while the writers
    # run: how far behind it was when they stopped is part of the figure (the appends are
    # only as fast as the chain that keeps up with them).
    t0 = time.perf_counter()
    unlinked_at_end = AuditEvent.objects.filter(seq__gt=audit_unlinked().head_seq).count()
    while AuditEvent.objects.filter(seq__gt=audit_unlinked().head_seq).exists():
        if time.perf_counter() - t0 > 120:
            raise RuntimeError("bench: the audit events were not linked within 2 minutes")
        audit_link(wait_seconds=1.0)
    link_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    verified = verify_chain()
    verify = {
        "chain_ok": verified.ok,
        "events": verified.events,
        "verify_seconds": round(time.perf_counter() - t0, 2),
        "unlinked_when_writers_stopped": unlinked_at_end,
        "linked_all_within_seconds": round(link_seconds, 2),
    }
    log(f"audit: {rates} appends/s, chain ok {verified.ok}")
    for writers, run in runs.items():
        floors = {name: rate for name, rate in run.items() if name.endswith("floor_per_s")}
        log(f"audit floors at {writers} writers: {floors}")
        log(f"audit CPU at {writers} writers: {run['cpu']}")
    low, high = min(rates), max(rates)
    size_note = "" if high == 8 else f"size {b.size.name}: {high} writers, not 8; "
    vs_bare = {
        writers: round(rates[writers] / run["bare_commit_floor_per_s"], 2)
        if run.get("bare_commit_floor_per_s")
        else None
        for writers, run in runs.items()
    }
    return {
        # Issue 41's goal: this machine's own commit rate is the bar (the same writers'
        # bare INSERT + COMMIT of one row, measured in the same rounds).
        "audit_appends_vs_bare_1": figure(
            "audit_appends_vs_bare_1",
            vs_bare[low],
            errors=int(not verified.ok),
            note=f"{rates[low]:,.0f}/s ÷ bare {runs[low]['bare_commit_floor_per_s']:,.0f}/s",
        ),
        "audit_appends_vs_bare_8": figure(
            "audit_appends_vs_bare_8",
            vs_bare[high],
            errors=int(not verified.ok),
            writers=high,
            note=size_note
            + f"{rates[high]:,.0f}/s ÷ bare {runs[high]['bare_commit_floor_per_s']:,.0f}/s",
        ),
        "audit_appends_per_s_1": figure(
            "audit_appends_per_s_1",
            rates[low],
            errors=int(not verified.ok),
            chain=verify,
            note=_limits_note(runs[low]),
            detail=runs[low],
        ),
        "audit_appends_per_s_8": figure(
            "audit_appends_per_s_8",
            rates[high],
            errors=int(not verified.ok),
            writers=high,
            chain=verify,
            note=size_note + _limits_note(runs[high]),
            detail=runs[high],
        ),
    }


def _limits_note(run: dict[str, Any]) -> str:
    """What bounds the figure on this machine: the bare commit floor of the same writers, the
    rate of a round trip that writes nothing (no WAL flush: above it no design that sends a
    statement an event can go), and the rate all CPUs would reach at an append's measured CPU
    cost with no waiting."""
    cpu = run["cpu"]["append"]
    note = (
        f"bare INSERT+COMMIT {run['bare_commit_floor_per_s']:,.0f}/s; "
        f"SELECT round trip {run['round_trip_floor_per_s']:,.0f}/s"
    )
    if cpu["cpu_ceiling_per_s"] is not None:
        note += (
            f"; CPU ceiling {cpu['cpu_ceiling_per_s']:,}/s (an append: "
            f"{cpu['writer_cpu_us']} µs Python + {cpu['backend_cpu_us']} µs PostgreSQL)"
        )
    return note


# --- hot resource --------------------------------------------------------------------------


def _hot_round(b: Bench, writers: int) -> dict[str, Any]:
    """`writers` clients of one fresh run loop read → write on one fresh resource."""
    name = f"{'hot' if writers > 1 else 'solo'}-{_tag()}"
    handle = fixtures.run_for(b.world, [f"bench-doc/{name}"], task=f"bench: hot {name}")
    fixtures.create_resources(handle, "bench-doc", [name], {"counter": 0})
    result = b.loadgen(
        {
            "mode": "hot",
            "port": b.stack.web_port,
            "token": handle.token,
            "resource": f"bench-doc/{name}",
            "writers": writers,
            "duration": b.size.hot_seconds,
        },
        timeout=b.size.hot_seconds + 180,
    )
    actions = Action.objects.filter(kind_id="bench-doc", name=name, operation="update")
    fixtures.wait_final([str(pk) for pk in actions.values_list("id", flat=True)], timeout=30)
    row = Resource.objects.get(kind_id="bench-doc", name=name)
    applied = actions.filter(status="applied").count()
    counter = int(row.document.get("counter") or 0)
    # Lost: an applied increment missing from the document, or a write a client was told
    # was applied that the database does not hold as applied.
    result["lost_updates"] = (applied - counter) + max(0, result["accepted"] - applied)
    result["db_applied"] = applied
    result["final_version"] = row.version
    result["accepted_per_s"] = round(applied / result["seconds"], 2)
    return result


def hot_resource(b: Bench) -> dict[str, Any]:
    """One uncontended agent and `hot_writers` contending agents, each on a fresh resource,
    in windows interleaved round by round; the figure is the median of the per-round ratios
    (who wins a round and how long the losers back off is luck: one 15-s window ranged
    0.39-0.86 in repeats at the same commit)."""
    rounds = [
        (_hot_round(b, 1), _hot_round(b, b.size.hot_writers)) for _ in range(b.size.hot_rounds)
    ]
    ratios = [
        round(hot["accepted_per_s"] / solo["accepted_per_s"], 2) if solo["accepted_per_s"] else 0.0
        for solo, hot in rounds
    ]
    log(
        "hot: "
        + "; ".join(
            f"{h['accepted_per_s']}/s contended, {s['accepted_per_s']}/s single" for s, h in rounds
        )
        + f"; ratios {ratios}"
    )
    limited = sum(s["rate_limited_429"] + h["rate_limited_429"] for s, h in rounds)
    note = f"{limited} writes refused 429 by the default per-token rate limit" if limited else ""
    if len(rounds) > 1:
        note = "; ".join(filter(None, [f"median of {len(rounds)} rounds: {ratios}", note]))
    return {
        "hot_resource_lost_updates": figure(
            "hot_resource_lost_updates",
            sum(s["lost_updates"] + h["lost_updates"] for s, h in rounds),
            writers=b.size.hot_writers,
        ),
        "hot_resource_vs_single": figure(
            "hot_resource_vs_single",
            statistics.median(ratios) if ratios else None,
            ratios=ratios,
            rounds=[{"single": s, "contended": h} for s, h in rounds],
            note=note,
        ),
    }


# Every group but the GETs under wrk (bench/gets.py) and the last, scale: both import this
# module, so bench.run puts the GETs first and appends scale.
FIGURES = {
    "longpoll": (longpoll, ["longpoll_held", "longpoll_wake_p99_ms"]),
    "roundtrip": (
        round_trip,
        [
            "decision_request_vs_bare_p50",
            "approval_round_trip_p50_ms",
            "approval_round_trip_p99_ms",
        ],
    ),
    "drain": (drain, ["approved_writes_vs_noop_jobs", "approved_writes_per_s"]),
    "core": (core_write, ["core_write_vs_bare_update"]),
    "audit": (
        audit,
        [
            "audit_appends_vs_bare_1",
            "audit_appends_vs_bare_8",
            "audit_appends_per_s_1",
            "audit_appends_per_s_8",
        ],
    ),
    "hot": (hot_resource, ["hot_resource_lost_updates", "hot_resource_vs_single"]),
    "recovery": (recovery.worker_kill_recovery, recovery.KEYS),
}
