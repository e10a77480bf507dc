"""`make bench`: start the real stack on loopback, measure every figure of issue 11's goal
table, write bench/results/latest.json and print the table.

    python -m bench.run [--size tiny|small|default] [--out PATH] [--only poll,drain,...]

Database: BENCH_DATABASE_URL (default airlock_bench on the local server; dropped and
re-created). Redis: a private redis-server on BENCH_REDIS_PORT (default: a free port).
The product runs as the Procfile starts it with default settings; the bare baseline runs
beside it under gunicorn sync. A figure whose piece fails is `null` with the reason; the bench
never fails on speed (exit 1 only when the stack itself cannot start).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import report
from bench.sizes import SIZES, Size
from bench.stack import ROOT, Stack, free_port, log

if TYPE_CHECKING:  # bench.figures imports models: only after django.setup() at run time
    from bench.figures import Bench

DEFAULT_DATABASE = "postgres://postgres@127.0.0.1:5432/airlock_bench"


def _machine_load() -> str:
    with contextlib.suppress(OSError):
        one, five, _ = os.getloadavg()
        return f"Load average at the start: {one:.1f} (1 min), {five:.1f} (5 min)."
    return ""


def _setup_django(stack: Stack) -> None:
    """The orchestrator talks to the same database and Redis as the product (fixtures and
    read-back); it serves nothing."""
    env = stack.env
    for key in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "AIRLOCK_DATA_DIR"):
        os.environ[key] = env[key]
    os.environ["DJANGO_SETTINGS_MODULE"] = "console.settings"
    import django  # here: settings must come from the stack's environment set just above

    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _start(stack: Stack, size: Size) -> Bench:
    """Database, Redis, migrations, then the Procfile's processes and the bare baseline."""
    stack.create_database()
    stack.start_redis()
    stack.migrate()
    _setup_django(stack)
    from bench import figures, fixtures  # here: they import models (Django set up above)

    world = fixtures.bootstrap()
    stack.start_web()
    stack.start_workers(figures.WORKERS)
    for line in ("notify", "cron", "audit"):  # deliveries, the cron, the audit linker
        if line in stack.procfile:
            stack.start_procfile(line)
    stack.start_bare()
    main = fixtures.run_for(world, ["bench-wait/*", "bench-call/*"], task="bench: API figures")
    core = fixtures.run_for(world, ["bench-core/*"], task="bench: core path")
    poll_action = fixtures.pending(main, "bench-wait", ["poll-1"])[0]
    return figures.Bench(stack, world, size, main, core, poll_action)


def _measure(bench: Bench, only: set[str]) -> dict[str, Any]:
    # Here: they import models (Django set up in _start).
    from bench import notify
    from bench.figures import FIGURES
    from bench.gets import GROUPS as GETS
    from bench.proposals import GROUPS as PROPOSALS
    from bench.scale import KEYS, scale
    from bench.targets_figure import KEYS as TARGET_KEYS
    from bench.targets_figure import target_writes

    groups = {
        **GETS,
        **PROPOSALS,
        **FIGURES,
        "notify": (notify.black_hole_round_trip, notify.KEYS),
        "targets": (target_writes, TARGET_KEYS),
        "scale": (scale, KEYS),
    }
    out: dict[str, Any] = {}
    for name, (measure, keys) in groups.items():
        if only and name not in only:
            continue
        log(f"measuring {name}")
        t0 = time.monotonic()
        out.update(_guarded(name, keys, lambda m=measure: m(bench)))  # type: ignore[misc]
        log(f"{name}: {time.monotonic() - t0:.1f}s")
    return out


def _not_at_this_size(figures: dict[str, Any], clients: tuple[int, ...], size: str) -> None:
    """A client count this size does not measure (`small`: 8 and 128) says so, not "not
    reached" (which means the run stopped before the figure)."""
    for key, fig in figures.items():
        count = key.rsplit("_", 1)[-1]
        if "vs_bare" not in key or key.startswith("audit_") or not count.isdigit():
            continue
        if fig.get("not_measured") and int(count) not in clients:
            fig["not_measured"] = f"size {size} measures {', '.join(map(str, clients))} clients"


def _guarded(name: str, keys: list[str], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"[:600]
        log(f"{name}: not measured — {reason}")
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return report.not_measured(keys, reason)


def _stack_description(stack: Stack) -> dict[str, Any]:
    return {
        "procfile": stack.procfile,
        "workers": "the Procfile's worker line, 2 processes",
        "bare": "gunicorn console.wsgi:application (bench.settings), sync, 2 workers",
        "database": "PostgreSQL on loopback, a fresh database",
        "redis": "a private redis-server on loopback",
        "load": "wrk (one thread) for HTTP throughput; asyncio waiters for long-polls",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Airlock's bench (issue 11's goal table)")
    parser.add_argument("--size", default=os.environ.get("BENCH_SIZE", "default"), choices=SIZES)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    parser.add_argument("--only", default="", help="comma-separated figure groups")
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    workdir = Path(os.environ.get("BENCH_WORKDIR", tempfile.gettempdir()))
    workdir /= f"airlock-bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(
        database_url=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE),
        redis_port=int(os.environ.get("BENCH_REDIS_PORT") or free_port()),
        workdir=workdir,
    )
    doc: dict[str, Any] = {
        "size": args.size,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_note": _machine_load(),
        "stack": _stack_description(stack),
        "figures": report.not_measured(list(report.GOALS), "not reached"),
    }
    code = 0
    try:
        log(f"size {args.size}: web :{stack.web_port}, bare :{stack.bare_port}, logs {workdir}")
        bench = _start(stack, SIZES[args.size])
        doc["figures"].update(_measure(bench, {s for s in args.only.split(",") if s}))
        _not_at_this_size(doc["figures"], SIZES[args.size].clients, args.size)
    except Exception as exc:
        doc["stack_error"] = f"{type(exc).__name__}: {exc}"[:800]
        log(f"the stack did not come up: {doc['stack_error']}")
        traceback.print_exc()
        code = 1
    finally:
        stack.stop_all()
    doc["seconds"] = round(time.monotonic() - started, 1)
    report.write(doc, Path(args.out))
    text = report.render(doc)
    print(text)
    if args.write_readme:
        report.write_readme(text)
    log(f"wrote {args.out} in {doc['seconds']}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
