"""`make bench`'s figures for issue 39's end-to-end write per target adapter: bench.targets_e2e
run in a process of its own (it sets Django up afresh on a database of its own), its ratios
reported with their goals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.report import figure

# The figures `make bench` reports (bench/run.py), one per adapter.
KEYS = [
    "target_write_vs_bare_postgres",
    "target_write_vs_bare_http_etag",
    "target_write_vs_bare_git",
]


def target_writes(b: Any) -> dict[str, Any]:
    """The bench's figures: bench.targets_e2e in a process of its own (Django set up afresh on a
    database of its own, `<the bench's database>_targets`), `core_n` rounds per adapter."""
    database = b.stack.database_url.rsplit("/", 1)
    env = {**b.stack.env, "BENCH_DATABASE_URL": f"{database[0]}/{database[1]}_targets"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.targets_e2e", "--rounds", str(b.size.core_n)],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench.targets_e2e failed: {done.stderr[-1500:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        key: figure(key, measured[adapter]["ratio"], **measured[adapter])
        for key, adapter in zip(KEYS, ("postgres", "http_etag", "git"), strict=True)
    }
