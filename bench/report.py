"""The one renderer: every figure with its goal, as bench/results/latest.json and as the
Markdown table printed after a run and kept in README's Performance section.

    python -m bench.report [bench/results/latest.json] [--write-readme]
"""

from __future__ import annotations

import json
import operator
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


@dataclass(frozen=True)
class Goal:
    label: str
    op: str
    target: float
    unit: str = ""

    def met(self, value: float) -> bool:
        compare: dict[str, Callable[[float, float], bool]] = {
            ">=": operator.ge,
            "<=": operator.le,
            "<": operator.lt,
            "==": operator.eq,
        }
        return compare[self.op](value, self.target)

    def __str__(self) -> str:
        return f"{self.op} {self.target:g}{self.unit}"


# Issue 11's goal table, one row per figure, in the order the table shows them.
GOALS: dict[str, Goal] = {
    "poll_vs_bare_8": Goal("poll ÷ bare token view, 8 clients (0 errors)", ">=", 0.9),
    "poll_vs_bare_32": Goal("poll ÷ bare token view, 32 clients (0 errors)", ">=", 0.9),
    "poll_vs_bare_128": Goal("poll ÷ bare token view, 128 clients (0 errors)", ">=", 0.9),
    "poll_304_vs_200": Goal("304 poll ÷ 200 poll", ">=", 1.5),
    **{
        f"{name}_304_vs_200": Goal(f"{label}: 304 ÷ 200, 8 clients", ">=", 1.5)
        for name, label in (
            ("action_agent", "action poll, agent token"),
            ("run_run", "run poll, run token"),
            ("run_agent", "run poll, agent token"),
            ("resource_run", "resource read, run token"),
            ("resource_agent", "resource read, agent token"),
        )
    },
    **{
        f"{name}_vs_bare_{clients}": Goal(
            f"{label} ÷ bare token view, {clients} clients (0 errors)", ">=", 0.9
        )
        for name, label in (
            ("action_agent", "action poll, agent token"),
            ("run_run", "run poll, run token"),
            ("run_agent", "run poll, agent token"),
            ("resource_run", "resource read, run token"),
            ("resource_agent", "resource read, agent token"),
            ("list_run", "resource list page (50 items), run token"),
            ("list_agent", "resource list page (50 items), agent token"),
        )
        for clients in (8, 32, 128)
    },
    **{
        f"proposal_vs_bare_insert_{clients}": Goal(
            f"write proposal (PATCH → 202 queued) ÷ bare token check + INSERT view, {clients} "
            "clients (0 errors)",
            ">=",
            0.5,
        )
        for clients in (8, 32, 128)
    },
    "longpoll_held": Goal("long-polls held by the default web processes", ">=", 2000),
    "longpoll_wake_p99_ms": Goal("long-poll wake-up p99", "<", 100, " ms"),
    "approval_round_trip_p50_ms": Goal("approval round trip p50 (200 waiting)", "<", 15, " ms"),
    "approval_round_trip_p99_ms": Goal("approval round trip p99 (200 waiting)", "<", 40, " ms"),
    "decision_request_vs_bare_p50": Goal(
        "approval decision request p50 ÷ bare token view p50 (same client, same run)", "<=", 3
    ),
    "approved_writes_vs_noop_jobs": Goal("approved-write drain ÷ RQ no-op job rate", ">=", 0.5),
    "approved_writes_per_s": Goal("approved writes drained per second", ">=", 500, "/s"),
    "core_write_vs_bare_update": Goal("core write p50 ÷ bare conditional UPDATE", "<=", 10),
    "audit_appends_per_s_1": Goal("audit appends/s, 1 writer (chain verified)", ">=", 5000, "/s"),
    "audit_appends_per_s_8": Goal("audit appends/s, 8 writers (chain verified)", ">=", 10000, "/s"),
    "audit_appends_vs_bare_1": Goal(
        "audit appends ÷ bare INSERT+COMMIT, 1 writer (chain verified)", ">=", 0.8
    ),
    "audit_appends_vs_bare_8": Goal(
        "audit appends ÷ bare INSERT+COMMIT, 8 writers (chain verified)", ">=", 0.5
    ),
    "hot_resource_lost_updates": Goal("hot resource: lost updates", "==", 0),
    "hot_resource_vs_single": Goal("hot resource: accepted/s ÷ one agent's", ">=", 0.5),
    "worker_kill_recovery_p50_s": Goal(
        "recovery after a worker kill mid-write, p50", "<", 30, " s"
    ),
    "worker_kill_recovery_max_s": Goal(
        "recovery after a worker kill mid-write, max", "<", 30, " s"
    ),
    # Issue 39 sets no bar for these; the core write's (Airlock's own store) is the one shown.
    "target_write_vs_bare_postgres": Goal(
        "approved write end to end ÷ bare conditional UPDATE, postgres target", "<=", 10
    ),
    "target_write_vs_bare_http_etag": Goal(
        "approved write end to end ÷ bare PUT If-Match, http target (WsgiDAV)", "<=", 10
    ),
    "target_write_vs_bare_git": Goal(
        "approved write end to end ÷ bare git commit + update-ref, git target", "<=", 10
    ),
    "notify_black_hole_round_trip_ratio": Goal(
        "approval round trip p50 without ÷ with a black-hole webhook subscriber", ">=", 0.9
    ),
    "scale_poll_p50_ratio": Goal("poll p50 at scale ÷ at 10³ (each ÷ bare view)", "<=", 1.2),
    "scale_core_write_p50_ratio": Goal(
        "core write p50 at scale ÷ at 10³ (each ÷ bare UPDATE)", "<=", 1.2
    ),
}


def figure(key: str, value: float | None, *, errors: int = 0, **detail: Any) -> dict[str, Any]:
    """One figure with its goal beside it; `errors` > 0 means the goal is not met."""
    goal = GOALS[key]
    met = None if value is None else goal.met(value) and errors == 0
    return {"value": value, "goal": str(goal), "met": met, "errors": errors, **detail}


def not_measured(keys: list[str], reason: str) -> dict[str, dict[str, Any]]:
    return {
        key: {"value": None, "goal": str(GOALS[key]), "met": None, "not_measured": reason}
        for key in keys
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.2f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _note(fig: dict[str, Any]) -> str:
    if fig.get("not_measured"):
        return f"not measured: {str(fig['not_measured']).splitlines()[0][:160]}"
    parts = [f"{fig['errors']} errors"] if fig.get("errors") else []
    parts += [str(fig["note"])] if fig.get("note") else []
    return "; ".join(parts)


def _median_of(values: list[Any]) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, int | float)]
    return statistics.median(numbers) if numbers else None


def instance_speed(figures: dict[str, dict[str, Any]]) -> str:
    """What this instance does with no product code in the way, measured in the same run:
    the figures that sit near their goal move with it (instances of one machine kind differ
    by 2x, and one instance's speed drifts within a run), so the table carries it."""
    bare_rounds = figures.get("poll_vs_bare_8", {}).get("rounds", [])
    parts = [
        ("the bare token view", _median_of([r["bare"]["rps"] for r in bare_rounds]), "{:,.0f}/s"),
        (
            "RQ's no-op jobs",
            figures.get("approved_writes_vs_noop_jobs", {}).get("noop_jobs_per_s"),
            "{:,.0f}/s",
        ),
        (
            "a bare INSERT + COMMIT, 1 writer",
            figures.get("audit_appends_per_s_1", {})
            .get("detail", {})
            .get("bare_commit_floor_per_s"),
            "{:,.0f}/s",
        ),
        (
            "a bare conditional UPDATE p50",
            figures.get("core_write_vs_bare_update", {})
            .get("detail", {})
            .get("bare_update_p50_ms"),
            "{:.2f} ms",
        ),
    ]
    known = [f"{name} {form.format(value)}" for name, value, form in parts if value is not None]
    return f"This instance in the same run: {'; '.join(known)}." if known else ""


def render(doc: dict[str, Any]) -> str:
    figures: dict[str, dict[str, Any]] = doc["figures"]
    lines = [
        f"`make bench BENCH_SIZE={doc['size']}`, {doc['started_at']}, "
        f"{doc['machine']['cpus']} CPUs, {doc.get('seconds', '?')} s. {doc.get('load_note', '')}",
        "",
        instance_speed(figures),
        "",
        "| figure | value | goal | met | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, goal in GOALS.items():
        fig = figures.get(key, {"value": None, "met": None, "not_measured": "missing"})
        met = {True: "yes", False: "no", None: "—"}[fig.get("met")]
        lines.append(f"| {goal.label} | {_fmt(fig.get('value'))} | {goal} | {met} | {_note(fig)} |")
    return "\n".join(lines)


def write(doc: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def write_readme(text: str) -> None:
    readme = ROOT / "README.md"
    head, _, rest = readme.read_text().partition(BEGIN)
    _, _, tail = rest.partition(END)
    readme.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("--")]
    path = Path(paths[0]) if paths else ROOT / "bench" / "results" / "latest.json"
    text = render(json.loads(path.read_text()))
    print(text)
    if "--write-readme" in argv:
        write_readme(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
