"""HTTP load from wrk (a compiled generator, so load costs little of the two cores)."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "lua" / "poll.lua"


@dataclass(frozen=True)
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    statuses: dict[str, int]
    errors: int  # socket errors, timeouts and every answer outside `ok` (200/304 by default)

    def as_dict(self) -> dict[str, object]:
        return {
            "rps": self.rps,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "requests": self.requests,
            "statuses": self.statuses,
            "errors": self.errors,
        }


def wrk_binary() -> str:
    binary = shutil.which("wrk")
    if binary is None:
        raise RuntimeError("wrk is not installed (scripts/bench.sh installs it with apt-get)")
    return binary


def run_wrk(
    url: str,
    *,
    clients: int,
    seconds: int,
    token: str = "",
    etag: str = "",
    script: Path = SCRIPT,
    script_args: list[str] | None = None,
    ok: tuple[str, ...] = ("200", "304"),
    timeout: str = "2s",
) -> WrkResult:
    """`clients` keep-alive connections on one wrk thread for `seconds`: the poll script with
    `token` and `etag`, or `script` with `script_args`; an answer outside `ok` is an error."""
    # An answer slower than `timeout` (2 s: as it would be for a polling agent) is an error.
    args = [wrk_binary(), "-t1", f"-c{clients}", f"-d{seconds}s", "--timeout", timeout]
    args += ["-s", str(script), url, "--", *(script_args if script_args else [token, etag])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("WRK_JSON ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-800:]}")
    raw = json.loads(lines[-1].removeprefix("WRK_JSON "))
    statuses = {str(k): int(v) for k, v in sorted(raw["statuses"].items())}
    bad = sum(n for code, n in statuses.items() if code not in ok)
    if not raw["requests"]:
        bad += clients  # nothing answered at all: every connection's request was lost
    return WrkResult(
        rps=round(raw["requests"] / max(raw["duration_us"], 1) * 1e6, 1),
        p50_ms=round(raw["p50_us"] / 1000, 2),
        p99_ms=round(raw["p99_us"] / 1000, 2),
        requests=int(raw["requests"]),
        statuses=statuses,
        errors=bad + int(raw["socket_errors"]) + int(raw["timeouts"]),
    )
