"""`make bench` runs end to end on a tiny size. It measures; it never asserts speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from bench.gets import REVALIDATED_FIGURES
from bench.report import GOALS
from bench.stack import read_procfile
from tests.conftest import ROOT

# The tiny size polls (and proposes) with 8 clients only.
NOT_IN_TINY = {
    key
    for key in GOALS
    if key.endswith(("_vs_bare_32", "_vs_bare_128", "_vs_bare_insert_32", "_vs_bare_insert_128"))
}


def run_bench_module(args: list[str], *, database: str, extra_env: dict[str, str]) -> str:
    """`python -m <args>` against a bench database of its own (dropped afterwards); its stdout.
    The bench re-creates BENCH_DATABASE_URL, so it must never be the tests' database."""
    server = urlsplit(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/airlock"))
    bench_url = urlunsplit(server._replace(path=f"/{database}"))
    env = {**os.environ, **extra_env, "BENCH_DATABASE_URL": bench_url}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        with psycopg.connect(make_conninfo(bench_url, dbname="postgres"), autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_bench_runs_on_a_tiny_size_and_writes_every_figure_with_its_goal(
    tmp_path: Path,
) -> None:
    out = tmp_path / "latest.json"
    stdout = run_bench_module(
        ["bench.run", "--size", "tiny", "--out", str(out)],
        database=f"airlock_bench_t{os.getpid()}",
        extra_env={"BENCH_WORKDIR": str(tmp_path)},
    )
    doc = json.loads(out.read_text())
    assert "stack_error" not in doc
    assert "| figure | value | goal |" in stdout  # the one renderer's table
    # ... headed by what the instance itself did in the same run, every baseline found.
    speed = next(line for line in stdout.splitlines() if line.startswith("This instance"))
    for baseline in ("bare token view", "no-op jobs", "INSERT + COMMIT", "conditional UPDATE"):
        assert baseline in speed, speed
    figures = doc["figures"]
    assert set(figures) == set(GOALS)
    for key, fig in figures.items():
        assert fig["goal"] == str(GOALS[key]), key
        if key not in NOT_IN_TINY:
            assert "not_measured" not in fig, (key, fig)
            assert fig["value"] is not None, (key, fig)
    # The stack is the Procfile's, started with default settings, beside the bare baseline.
    assert doc["stack"]["procfile"] == read_procfile(ROOT / "Procfile")
    # Correctness is not speed: the hot resource never loses an update, the chain verifies.
    assert figures["hot_resource_lost_updates"]["value"] == 0
    # ... and a worker killed mid-write leaves its write applied exactly once (bench.recovery).
    assert figures["worker_kill_recovery_p50_s"]["errors"] == 0, figures[
        "worker_kill_recovery_p50_s"
    ]
    assert figures["audit_appends_per_s_1"]["chain"]["chain_ok"] is True
    # Every write proposal answered 202 and was applied, every bare INSERT answered 202.
    proposal = figures["proposal_vs_bare_insert_8"]
    assert proposal["errors"] == 0, proposal
    assert proposal["proposal_rps"] > 0 and proposal["bare_rps"] > 0, proposal
    assert set(proposal["proposal_statuses"]) == {"202"} == set(proposal["bare_statuses"])
    # Every agent GET with an ETag was revalidated: each If-None-Match run answered 304 only.
    for key in REVALIDATED_FIGURES:
        assert figures[key]["answers_not_304"] == 0 and figures[key]["value"] > 0, figures[key]
    # The black-hole figure's subscriber heard every timed decision and the hole was tried.
    hole = figures["notify_black_hole_round_trip_ratio"]
    assert hole["errors"] == 0 and hole["black_hole"]["attempted"], hole
    # What bounds the audit figure is measured beside it: the CPU an append costs.
    cpu = figures["audit_appends_per_s_1"]["detail"]["cpu"]["append"]
    assert cpu["writer_cpu_us"] > 0, cpu
    if cpu["backend_cpu_us"] is not None:  # None where PostgreSQL is not a local process
        assert cpu["backend_cpu_us"] > 0 and cpu["cpu_ceiling_per_s"] > 0, cpu
        assert "CPU ceiling" in figures["audit_appends_per_s_1"]["note"]
    # The scale figures read each round against its baseline, the raw ratio beside them.
    for key in ("scale_poll_p50_ratio", "scale_core_write_p50_ratio"):
        assert figures[key]["raw_p50_ratio"] is not None, figures[key]
    for point in ("small", "big"):
        measured = figures["scale_poll_p50_ratio"][point]
        assert measured["bare_view_p50s_ms"] and measured["poll_vs_bare_view"] > 0, measured
        assert measured["core_vs_bare"] > 0, measured
    # ... and the floors: a bare commit, and a round trip that commits nothing.
    detail = figures["audit_appends_per_s_1"]["detail"]
    assert detail["bare_commit_floor_per_s"] > 0 and detail["round_trip_floor_per_s"] > 0
    assert "SELECT round trip" in figures["audit_appends_per_s_1"]["note"]


@pytest.mark.slow
def test_the_in_process_poll_cost_compares_both_asgi_handlers_on_every_poll() -> None:
    stdout = run_bench_module(
        ["bench.asgi_cpu", "--rounds", "2", "--polls", "16"],
        database=f"airlock_bench_c{os.getpid()}",
        extra_env={},
    )
    result = json.loads(stdout.strip().splitlines()[-1])
    assert set(result) == {"console.asgi", "django_asgi"}
    for figures in result.values():
        assert figures["statuses"] == {"200": 32}  # every poll answered, nothing else
        assert figures["cpu_ms_per_poll"] > 0
        assert figures["polls_per_s"] > 0


@pytest.mark.slow
def test_the_in_process_cost_of_a_list_page_is_measured_on_a_full_page() -> None:
    """`--get list`: the list's query string reaches the application (a path without it
    was answered 404 and measured as if it were the page)."""
    stdout = run_bench_module(
        ["bench.asgi_cpu", "--rounds", "2", "--polls", "16", "--get", "list", "--everything"],
        database=f"airlock_bench_l{os.getpid()}",
        extra_env={},
    )
    result = json.loads(stdout.strip().splitlines()[-1])
    # No ETag on the list: --everything adds Django's application alone, and no 304.
    assert set(result) == {"console.asgi", "console.asgi django", "django_asgi"}
    for figures in result.values():
        assert figures["statuses"] == {"200": 32}
        assert figures["cpu_ms_per_poll"] > 0


@pytest.mark.slow
def test_the_in_process_proposal_cost_measures_both_kinds_of_write() -> None:
    stdout = run_bench_module(
        ["bench.proposal_cpu", "--rounds", "2", "--writes", "8"],
        database=f"airlock_bench_p{os.getpid()}",
        extra_env={},
    )
    result = json.loads(stdout.strip().splitlines()[-1])
    assert set(result) == {"per_call", "queued"}
    for figures in result.values():
        assert figures["statuses"] == {"202": 16}  # every proposal accepted, nothing else
        assert figures["cpu_ms_per_proposal"] > 0
        assert figures["proposals_per_s"] > 0
