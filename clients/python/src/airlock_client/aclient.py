"""The asynchronous client: `AsyncAirlock` and `AsyncRunSession`, the same surface as
`Airlock` and `RunSession` with `await` (and `async with`).

    async with AsyncAirlock("http://127.0.0.1:8000", agent_token) as airlock:
        run = await airlock.start_run("add a backup destination",
                                      [("notification-policy/prod-alerts", ["update"])])
        async with run:
            policy = await run.read("notification-policy/prod-alerts")
            action = await run.patch(policy, {"severity": "critical"}, reason="why")
            action = await run.wait(action, timeout=300)

Every method is defined once in `_surface` (shared with the sync client); this module
only sends the requests and sleeps between retries, without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx

from airlock_client._protocol import Exchange, Op
from airlock_client._surface import AirlockCore, ExcType, SessionCore, heartbeat_interval
from airlock_client.errors import RunNotActive
from airlock_client.models import Run

T = TypeVar("T")
P = ParamSpec("P")
Owner = TypeVar("Owner")
Scoped = TypeVar("Scoped", bound="_AsyncScoped")


def awaiting(
    op: Callable[Concatenate[Owner, P], Op[T]],
) -> Callable[Concatenate[Owner, P], Coroutine[Any, Any, T]]:
    """A method of `_surface` as a coroutine method of `AsyncAirlock` or
    `AsyncRunSession`: its operation, run to the answer."""

    @functools.wraps(op)
    async def method(self: Owner, /, *args: P.args, **kwargs: P.kwargs) -> T:
        assert isinstance(self, AsyncAirlock | AsyncRunSession)
        return await self._run(op(self, *args, **kwargs))

    return method


class _AsyncScoped:
    """`async with`: `_enter()` on the way in and, whatever happened, `_exit()` out."""

    def _enter(self) -> None:
        pass

    async def _exit(self) -> None:
        pass

    async def __aenter__(self: Scoped) -> Scoped:
        self._enter()
        return self

    async def __aexit__(
        self, exc_type: ExcType, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._exit()


class AsyncAirlock(AirlockCore["AsyncRunSession", httpx.AsyncClient], _AsyncScoped):
    """A connection to one Airlock server with one token (agent `ak_…` or run `rt_…`)."""

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout)

    def _session(self, run: Run, token: str) -> AsyncRunSession:
        return AsyncRunSession(self, run, token)

    async def _run(self, op: Op[T]) -> T:
        exchange = Exchange(op, self.base_url, self.retry, self.timeout)
        while (request := exchange.request) is not None:
            if request.delay:
                await asyncio.sleep(request.delay)
            try:
                exchange.answer(await self._http.send(request.build(self._http)))
            except httpx.TransportError as exc:
                exchange.broken(exc)
        return exchange.result

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    # The surface, defined in _surface.
    whoami = awaiting(AirlockCore._whoami)
    start_run = awaiting(AirlockCore._start_run)
    join_run = awaiting(AirlockCore._join_run)
    get_run = awaiting(AirlockCore._get_run)
    read = awaiting(AirlockCore._read)
    get_action = awaiting(AirlockCore._get_action)
    wait_for_action = awaiting(AirlockCore._wait_for_action)
    wait_for_supersede = awaiting(AirlockCore._wait_for_supersede)
    list_actions = awaiting(AirlockCore._list_actions)
    get_plan = awaiting(AirlockCore._get_plan)
    wait_for_plan = awaiting(AirlockCore._wait_for_plan)

    async def _exit(self) -> None:
        await self.close()


class AsyncRunSession(SessionCore[AsyncAirlock], _AsyncScoped):
    """One run (see RunSession): `async with` heartbeats while open, finishes on exit."""

    _beat_task: asyncio.Task[None] | None = None

    async def _run(self, op: Op[T]) -> T:
        return await self.client._run(op)

    # --- background heartbeat --------------------------------------------------------------

    def start_heartbeat(self, interval: float | None = None) -> None:
        if self._beat_task is None:
            every = interval or heartbeat_interval(self.run)
            self._beat_task = asyncio.get_running_loop().create_task(self._beat(every))

    async def _beat(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.heartbeat()
            except Exception as exc:
                if not self._keeps_beating(exc):
                    return

    async def stop_heartbeat(self) -> None:
        if self._beat_task is not None:
            self._beat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat_task
            self._beat_task = None

    def _enter(self) -> None:
        if self.run.active:
            self.start_heartbeat()

    async def _exit(self) -> None:
        await self.stop_heartbeat()
        if not self.run.ended:
            with contextlib.suppress(RunNotActive):
                await self.finish()

    # The surface, defined in _surface.
    refresh = awaiting(SessionCore._refresh)
    wait_for_approval = awaiting(SessionCore._wait_for_approval)
    read = awaiting(SessionCore._read)
    put = awaiting(SessionCore._put)
    patch = awaiting(SessionCore._patch)
    delete = awaiting(SessionCore._delete)
    create = awaiting(SessionCore._create)
    wait = awaiting(SessionCore._wait_for_action)
    wait_for_supersede = awaiting(SessionCore._wait_for_supersede)
    update = awaiting(SessionCore._update)
    undo = awaiting(SessionCore._undo)
    propose_plan = awaiting(SessionCore._propose_plan)
    wait_for_plan = awaiting(SessionCore._wait_for_plan)
    actions = awaiting(SessionCore._actions)
    heartbeat = awaiting(SessionCore._heartbeat)
    finish = awaiting(SessionCore._finish)
