"""The web process's own cost of one agent poll, without HTTP and without wrk: CPU
milliseconds per 200 poll (every thread of this process; PostgreSQL's work is not in it)
and polls per second, 8 at a time, through console.asgi's application (the poll's front over
Django), interleaved round by round with Django's plain ASGIHandler (whose MiddlewareMixin
hands every middleware hook to a thread); `--everything` adds console.asgi's Django
application alone (what the front hands off to) and the 304s of both. Less sensitive to a
busy machine than the wrk figures.

    python -m bench.asgi_cpu [--rounds 5] [--polls 800] [--everything] [--get list]

`--get` picks the GET: `action` (the default: an action poll with its run token), `list` (a
full page of the resource list, LIST_PAGE resources, with the run token; no 304: the list has
no ETag) or `resource` (one resource's read, and its 304).

Database: BENCH_DATABASE_URL (dropped and re-created, as by bench.run); a private Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.handlers.asgi import ASGIHandler

from bench.asgi_get import App, asgi_get
from bench.in_process import alternated_rounds, web_process_django

CONCURRENT = 8


async def _poll(app: App, path: str, token: str, etag: str, statuses: dict[int, int]) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    if etag:
        headers["If-None-Match"] = etag
    messages = await asgi_get(app, path, host="127.0.0.1", headers=headers)
    status = next(m["status"] for m in messages if m["type"] == "http.response.start")
    statuses[status] = statuses.get(status, 0) + 1


async def _round(app: App, path: str, token: str, etag: str, polls: int) -> dict[str, Any]:
    statuses: dict[int, int] = {}

    async def client(count: int) -> None:
        for _ in range(count):
            await _poll(app, path, token, etag, statuses)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client(polls // CONCURRENT) for _ in range(CONCURRENT)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    done = sum(statuses.values())
    return {"cpu_ms": cpu / done * 1000, "per_s": done / wall, "statuses": statuses}


def _applications() -> dict[str, App]:
    """console.asgi's application (the poll's fast path in front of Django), the Django
    application behind it alone, and the same on Django's plain handler."""
    # reason: they load the middlewares, which need django.setup() (done in main)
    from approvals.api.fastpoll import PollFront
    from console.middleware import AirlockASGIHandler

    django = ASGIStaticFilesHandler(AirlockASGIHandler())
    return {
        "console.asgi": PollFront(django),
        "console.asgi django": django,
        "django_asgi": ASGIStaticFilesHandler(ASGIHandler()),
    }


async def _measure(
    path: str, token: str, etag: str, rounds: int, polls: int, *, everything: bool
) -> dict[str, Any]:
    apps = _applications()
    if not everything:
        apps.pop("console.asgi django")
    # Each application's 200 poll; with everything, also the 304 (If-None-Match) of the
    # front and of the Django application behind it.
    runs = {name: (app, "") for name, app in apps.items()}
    if everything and etag:  # (the list has no ETag, and so no 304)
        runs.update({f"{name} 304": (apps[name], etag) for name in list(apps)[:2]})
    for app, tag in runs.values():  # warm: connections, prepared statements, imports
        await _round(app, path, token, tag, CONCURRENT * 10)

    def measure(app: App, tag: str) -> Callable[[], Awaitable[dict[str, Any]]]:
        return lambda: _round(app, path, token, tag, polls)

    measures = {name: measure(app, tag) for name, (app, tag) in runs.items()}
    return await alternated_rounds("asgi_cpu", measures, rounds, "poll")


def _target(get: str, run: Any) -> tuple[str, str]:
    """The path the GET reads and the ETag its 304 sends ("" for the list: it has none). The
    resources are stored directly (no worker runs here): the read is what is measured."""
    # reason: they import models (Django set up in main)
    from bench import fixtures
    from bench.gets import LIST_PAGE
    from ownership.models import Resource

    if get == "action":
        action = fixtures.pending(run, "bench-wait", ["asgi-cpu-1"])[0]
        return f"/api/v1/actions/{action.action_id}", action.etag
    names = [f"asgi-cpu-{n:03d}" for n in range(LIST_PAGE + 1)]
    Resource.objects.bulk_create(
        Resource(kind_id="bench-doc", name=name, document={"n": n, "name": name}, version=1)
        for n, name in enumerate(names)
    )
    if get == "list":
        return "/api/v1/resources?kind=bench-doc&prefix=asgi-cpu-", ""
    return f"/api/v1/resources/bench-doc/{names[0]}", '"1"'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--polls", type=int, default=800)
    parser.add_argument(
        "--everything",
        action="store_true",
        help="also the Django application behind the poll's front, and the 304s",
    )
    parser.add_argument("--get", choices=("action", "list", "resource"), default="action")
    args = parser.parse_args(argv)
    with web_process_django("airlock-asgi-cpu-"):
        from bench import fixtures  # here: it imports models (Django set up above)

        world = fixtures.bootstrap()
        run = fixtures.run_for(world, ["bench-wait/*"], task="bench: asgi cpu")
        path, etag = _target(args.get, run)
        result = asyncio.run(
            _measure(path, run.token, etag, args.rounds, args.polls, everything=args.everything)
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
