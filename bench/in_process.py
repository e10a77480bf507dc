"""What the in-process cost tools (bench.asgi_cpu, bench.proposal_cpu) share: a stack of their
own with Django set up in this process as a web process has it, and their rounds, alternated
and summed up."""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.run import DEFAULT_DATABASE, _setup_django
from bench.stack import Stack, free_port, log


@contextmanager
def web_process_django(prefix: str, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """BENCH_DATABASE_URL dropped, re-created and migrated, a private Redis, and Django set up
    in this process as in a web process (pooled connections: console.settings, SERVES_ASGI),
    with `env` set first; all stopped when the block ends."""
    stack = Stack(
        database_url=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE),
        redis_port=free_port(),
        workdir=Path(tempfile.mkdtemp(prefix=prefix)),
    )
    try:
        stack.create_database()
        stack.start_redis()
        stack.migrate()
        os.environ.update({"AIRLOCK_DB_POOL": "true", **(env or {})})
        _setup_django(stack)
        yield stack
    finally:
        stack.stop_all()


async def alternated_rounds(
    label: str, measures: dict[str, Callable[[], Awaitable[dict[str, Any]]]], rounds: int, unit: str
) -> dict[str, dict[str, Any]]:
    """Each measure once a round, the order reversed every other round. A measure returns
    one round's `cpu_ms` (per `unit`), `per_s` and `statuses` (answers by HTTP status); the
    result, per measure: the rounds' medians as `cpu_ms_per_<unit>` and `<unit>s_per_s`, and
    their answers counted by status."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in measures}
    for number in range(rounds):
        order = list(measures) if number % 2 == 0 else list(reversed(measures))
        for name in order:
            results[name].append(await measures[name]())
            log(f"{label} round {number} {name}: {results[name][-1]}")
    return {
        name: {
            f"cpu_ms_per_{unit}": round(statistics.median(r["cpu_ms"] for r in runs), 2),
            f"{unit}s_per_s": round(statistics.median(r["per_s"] for r in runs), 1),
            "statuses": _status_totals(runs),
        }
        for name, runs in results.items()
    }


def _status_totals(rounds: list[dict[str, Any]]) -> dict[str, int]:
    """Every round's answers counted by HTTP status (as JSON keys)."""
    total: dict[str, int] = {}
    for measured in rounds:
        for status, count in measured["statuses"].items():
            total[str(status)] = total.get(str(status), 0) + count
    return total
