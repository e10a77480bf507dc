"""The synchronous client: `Airlock` (one per server + token) and `RunSession` (one run).

from airlock_client import Airlock, StaleVersion

with Airlock("http://127.0.0.1:8000", agent_token) as airlock:
    with airlock.start_run("add a backup destination",
                           [("notification-policy/prod-alerts", ["update"])]) as run:
        policy = run.read("notification-policy/prod-alerts")
        action = run.patch(policy, {"destinations": [...]}, reason="why")
        action = run.wait(action, timeout=300)

Every method is defined once in `_surface` (shared with the async client); this module
only sends the requests and sleeps between retries.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Concatenate, ParamSpec, TypeVar

import httpx

from airlock_client._protocol import USER_AGENT as USER_AGENT
from airlock_client._protocol import Exchange, Op
from airlock_client._surface import AirlockCore, ExcType, SessionCore, heartbeat_interval
from airlock_client._surface import WriteSetSpec as WriteSetSpec
from airlock_client._surface import write_set_json as write_set_json
from airlock_client.errors import RunNotActive
from airlock_client.models import Run

T = TypeVar("T")
P = ParamSpec("P")
Owner = TypeVar("Owner")
Scoped = TypeVar("Scoped", bound="_Scoped")


def blocking(op: Callable[Concatenate[Owner, P], Op[T]]) -> Callable[Concatenate[Owner, P], T]:
    """A method of `_surface` as a method of `Airlock` or `RunSession`: its operation,
    run to the answer."""

    @functools.wraps(op)
    def method(self: Owner, /, *args: P.args, **kwargs: P.kwargs) -> T:
        assert isinstance(self, Airlock | RunSession)
        return self._run(op(self, *args, **kwargs))

    return method


class _Scoped:
    """`with`: `_enter()` on the way in and, whatever happened, `_exit()` on the way out."""

    def _enter(self) -> None:
        pass

    def _exit(self) -> None:
        pass

    def __enter__(self: Scoped) -> Scoped:
        self._enter()
        return self

    def __exit__(
        self, exc_type: ExcType, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._exit()


class Airlock(AirlockCore["RunSession", httpx.Client], _Scoped):
    """A connection to one Airlock server with one token (agent `ak_…` or run `rt_…`)."""

    def _new_http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=self.timeout)

    def _session(self, run: Run, token: str) -> RunSession:
        return RunSession(self, run, token)

    def _run(self, op: Op[T]) -> T:
        exchange = Exchange(op, self.base_url, self.retry, self.timeout)
        while (request := exchange.request) is not None:
            if request.delay:
                time.sleep(request.delay)
            try:
                exchange.answer(self._http.send(request.build(self._http)))
            except httpx.TransportError as exc:
                exchange.broken(exc)
        return exchange.result

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    # The surface, defined in _surface.
    whoami = blocking(AirlockCore._whoami)
    start_run = blocking(AirlockCore._start_run)
    join_run = blocking(AirlockCore._join_run)
    get_run = blocking(AirlockCore._get_run)
    read = blocking(AirlockCore._read)
    get_action = blocking(AirlockCore._get_action)
    wait_for_action = blocking(AirlockCore._wait_for_action)
    wait_for_supersede = blocking(AirlockCore._wait_for_supersede)
    list_actions = blocking(AirlockCore._list_actions)
    get_plan = blocking(AirlockCore._get_plan)
    wait_for_plan = blocking(AirlockCore._wait_for_plan)

    def _exit(self) -> None:
        self.close()


class RunSession(SessionCore[Airlock], _Scoped):
    """One run: reads and writes with its run token. As a context manager it
    heartbeats in the background while open and finishes the run on exit."""

    _beat_thread: threading.Thread | None = None

    def _run(self, op: Op[T]) -> T:
        return self.client._run(op)

    # --- background heartbeat --------------------------------------------------------------

    def start_heartbeat(self, interval: float | None = None) -> None:
        if self._beat_thread is not None:
            return
        every = interval or heartbeat_interval(self.run)
        self._beat_stop = threading.Event()
        self._beat_thread = threading.Thread(
            target=self._beat,
            args=(every, self._beat_stop),
            name=f"airlock-heartbeat-{self.id}",
            daemon=True,
        )
        self._beat_thread.start()

    def _beat(self, every: float, stop: threading.Event) -> None:
        while not stop.wait(every):
            try:
                self.heartbeat()
            except Exception as exc:
                if not self._keeps_beating(exc):
                    return

    def stop_heartbeat(self) -> None:
        thread, self._beat_thread = self._beat_thread, None
        if thread is not None:
            self._beat_stop.set()
            thread.join(timeout=5)

    def _enter(self) -> None:
        if self.run.active:
            self.start_heartbeat()

    def _exit(self) -> None:
        self.stop_heartbeat()
        if not self.run.ended:
            with contextlib.suppress(RunNotActive):
                self.finish()

    # The surface, defined in _surface.
    refresh = blocking(SessionCore._refresh)
    wait_for_approval = blocking(SessionCore._wait_for_approval)
    read = blocking(SessionCore._read)
    put = blocking(SessionCore._put)
    patch = blocking(SessionCore._patch)
    delete = blocking(SessionCore._delete)
    create = blocking(SessionCore._create)
    wait = blocking(SessionCore._wait_for_action)
    wait_for_supersede = blocking(SessionCore._wait_for_supersede)
    update = blocking(SessionCore._update)
    undo = blocking(SessionCore._undo)
    propose_plan = blocking(SessionCore._propose_plan)
    wait_for_plan = blocking(SessionCore._wait_for_plan)
    actions = blocking(SessionCore._actions)
    heartbeat = blocking(SessionCore._heartbeat)
    finish = blocking(SessionCore._finish)
