"""What the in-process cost tools (bench.asgi_cpu, bench.proposal_cpu) share: a stack of their
own with Django set up in this process as a web process has it, and their answers' tally."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.run import DEFAULT_DATABASE, _setup_django
from bench.stack import Stack, free_port


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


def status_totals(rounds: list[dict[str, Any]]) -> dict[str, int]:
    """Every round's answers counted by HTTP status (as JSON keys)."""
    total: dict[str, int] = {}
    for measured in rounds:
        for status, count in measured["statuses"].items():
            total[str(status)] = total.get(str(status), 0) + count
    return total
