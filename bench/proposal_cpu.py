"""The web process's own cost of one agent write proposal, without HTTP: CPU milliseconds
per `PUT /api/v1/resources/{kind}/{name}` (every thread of this process; PostgreSQL's work is
not in it) and proposals per second, one at a time, through console.asgi's application as
the Procfile's web process runs it. Two kinds of proposal, interleaved round by round: a
create a person must approve (`per_call`: the action, its approval and two audit events)
and one that is queued at once (`queued`: the action, one event, the job enqueued after
commit). Each proposal names a new resource, so none is refused behind another.

    python -m bench.proposal_cpu [--rounds 5] [--writes 200]

Database: BENCH_DATABASE_URL (dropped and re-created, as by bench.run); a private Redis
(the queued proposals' jobs wait there: no worker runs).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bench.asgi_get import App, asgi_request
from bench.in_process import alternated_rounds, web_process_django

# kind (bench/fixtures.py KINDS) → what its create is: per-call (waits for a person) or
# per-run (auto-approved, queued at once).
KINDS = {"per_call": "bench-wait", "queued": "bench-doc"}
_names = itertools.count(1)


async def _propose(app: App, kind: str, token: str, statuses: dict[int, int]) -> None:
    name = f"pc-{next(_names)}"
    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/json",
        "If-None-Match": "*",
        "Idempotency-Key": f"bench-{uuid.uuid4().hex}",
    }
    messages = await asgi_request(
        app,
        "PUT",
        f"/api/v1/resources/{kind}/{name}",
        host="127.0.0.1",
        headers=headers,
        body=b'{"severity": "critical", "channels": ["pager"]}',
    )
    status = next(m["status"] for m in messages if m["type"] == "http.response.start")
    statuses[status] = statuses.get(status, 0) + 1


async def _round(app: App, kind: str, token: str, writes: int) -> dict[str, Any]:
    statuses: dict[int, int] = {}
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(writes):
        await _propose(app, kind, token, statuses)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    done = sum(statuses.values())
    return {"cpu_ms": cpu / done * 1000, "per_s": done / wall, "statuses": statuses}


async def _measure(token: str, rounds: int, writes: int) -> dict[str, Any]:
    # reason: they load the middlewares, which need django.setup() (done in main)
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    from approvals.api.fastpoll import PollFront
    from console.middleware import AirlockASGIHandler

    app = PollFront(ASGIStaticFilesHandler(AirlockASGIHandler()))
    for kind in KINDS.values():  # warm: connections, imports, the first request's setup
        await _round(app, kind, token, 10)

    def measure(kind: str) -> Callable[[], Awaitable[dict[str, Any]]]:
        return lambda: _round(app, kind, token, writes)

    measures = {name: measure(kind) for name, kind in KINDS.items()}
    return await alternated_rounds("proposal_cpu", measures, rounds, "proposal")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--writes", type=int, default=200)
    args = parser.parse_args(argv)
    # No write rate limit in the way of one token's many proposals.
    with web_process_django("airlock-proposal-cpu-", {"AIRLOCK_WRITE_RATE_PER_MINUTE": "1000000"}):
        from bench import fixtures  # here: it imports models (Django set up above)

        world = fixtures.bootstrap()
        patterns = [f"{kind}/pc-*" for kind in KINDS.values()]
        run = fixtures.run_for(world, patterns, task="bench: proposal cpu")
        result = asyncio.run(_measure(run.token, args.rounds, args.writes))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
