"""Render a bench result as the README's Performance table.

    python -m bench.report [bench/results/latest.json] [--write-readme]

Prints the Markdown; with --write-readme it replaces the block between the
`<!-- bench:begin -->` and `<!-- bench:end -->` markers in README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _get(node: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:,.2f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def render(doc: dict[str, Any]) -> str:
    f = doc["figures"]
    goals = doc.get("goals", {})
    rows: list[tuple[str, str, str]] = []

    def add(name: str, path: str, goal_key: str | None = None, note: str = "") -> None:
        goal = goals.get(goal_key or path, "")
        rows.append((f"`{name}`", _fmt(_get(f, path)) + (f" {note}" if note else ""), goal))

    add("poll_vs_bare", "poll_vs_bare", note="(worst of 8/32/128 clients)")
    add("poll_304_vs_200", "poll_304_vs_200", note="(worst)")
    for c, v in (f.get("poll") or {}).items():
        rows.append(
            (
                f"&nbsp;&nbsp;{c} clients",
                f"poll {_fmt(v['poll_rps'])} rps (p50 {_fmt(v['poll_p50_ms'])} / p99 "
                f"{_fmt(v['poll_p99_ms'])} ms), bare {_fmt(v['bare_token_view_rps'])} rps, "
                f"304 {_fmt(v['poll_304_rps'])} rps",
                "",
            )
        )
    add("longpoll_held", "longpoll_held")
    add("longpoll_wake_p99_ms", "longpoll_wake_p99_ms")
    add("longpoll server RSS at peak (MB)", "longpoll_server_rss_mb_peak")
    add("core_write_p50_ms", "core_write_p50_ms")
    add("core_write_vs_bare_update", "core_write_vs_bare_update")
    add("approved_writes_per_s", "approved_writes_per_s")
    rows.append(
        (
            "&nbsp;&nbsp;fork `Worker` / `SimpleWorker`",
            f"{_fmt(_get(f, 'approved_writes_fork.approved_writes_per_s'))} / "
            f"{_fmt(_get(f, 'approved_writes_simple.approved_writes_per_s'))} writes/s",
            "",
        )
    )
    add("hot_resource.lost_updates", "hot_resource.lost_updates")
    add("hot_resource.accepted_per_s", "hot_resource.accepted_per_s")
    add("hot_resource.vs_single_writer", "hot_resource.vs_single_writer")
    add("audit_append_per_s (1 writer)", "audit_append_per_s_1", "audit_append_per_s")
    add("audit_append_per_s (4 writers)", "audit_append_per_s_4", "audit_append_per_s")
    add("audit chain verifies", "audit_chain_ok")
    add("scale.poll_p50_ratio", "scale.poll_p50_ratio")
    add("scale.core_write_p50_ratio", "scale.core_write_p50_ratio")
    lines = [
        f"Latest run: `make bench` (size `{doc['size']}`), {doc['started_at']}, "
        f"{doc['machine']['cpus']} CPUs, Python {doc['machine']['python']}, "
        f"{doc.get('seconds', '?')} s.",
        "",
        "| figure | value | goal |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    if doc.get("not_measured"):
        lines += ["", "Not measured in that run:", ""]
        lines += [f"- `{k}`: {v.splitlines()[0][:200]}" for k, v in doc["not_measured"].items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    path = Path(args[0]) if args else ROOT / "bench" / "results" / "latest.json"
    text = render(json.loads(path.read_text()))
    print(text)
    if "--write-readme" in argv:
        readme = ROOT / "README.md"
        content = readme.read_text()
        head, _, rest = content.partition(BEGIN)
        _, _, tail = rest.partition(END)
        readme.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
