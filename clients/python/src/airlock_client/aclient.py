"""The asynchronous client: `AsyncAirlock` and `AsyncRunSession`, the same surface as
`Airlock` and `RunSession` with `await` (and `async with`).

    async with AsyncAirlock("http://127.0.0.1:8000", agent_token) as airlock:
        run = await airlock.start_run("add a backup destination",
                                      [("notification-policy/prod-alerts", ["update"])])
        async with run:
            policy = await run.read("notification-policy/prod-alerts")
            action = await run.patch(policy, {"severity": "critical"}, reason="why")
            action = await run.wait(action, timeout=300)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

import httpx

from airlock_client import _protocol as protocol
from airlock_client._protocol import Call, Op, RetryPolicy
from airlock_client.client import USER_AGENT, WriteSetSpec, heartbeat_interval, write_set_json
from airlock_client.errors import RunNotActive, RunNotApproved
from airlock_client.models import Action, Plan, Resource, Run

T = TypeVar("T")
logger = logging.getLogger("airlock_client")


class AsyncAirlock:
    """A connection to one Airlock server with one token (agent `ak_…` or run `rt_…`)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        retry_budget: float = 30.0,
        timeout: float = 30.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry = RetryPolicy(budget=retry_budget)
        self.timeout = httpx.Timeout(timeout)
        self._http = http or httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout)
        self._owns_http = http is None

    async def _send(self, call: Call) -> httpx.Response:
        attempts = protocol.Attempts(call, self.retry)
        while True:
            try:
                response = await self._http.request(
                    call.method,
                    self.base_url + call.path,
                    headers=attempts.headers(USER_AGENT),
                    content=call.content,
                    timeout=attempts.timeout(self.timeout),
                )
            except httpx.TransportError as exc:
                delay = attempts.after_transport_error(exc)
                logger.info("retrying %s %s in %.2fs: %s", call.method, call.path, delay, exc)
            else:
                next_delay = attempts.after_response(response)
                if next_delay is None:
                    return response
                delay = next_delay
                logger.info(
                    "retrying %s %s in %.2fs: %d",
                    call.method,
                    call.path,
                    delay,
                    response.status_code,
                )
            await asyncio.sleep(delay)

    async def _run(self, op: Op[T]) -> T:
        try:
            call = next(op)
            while True:
                call = op.send(await self._send(call))
        except StopIteration as stop:
            result: T = stop.value
            return result

    async def whoami(self) -> dict[str, Any]:
        return await self._run(protocol.whoami(self.token))

    async def start_run(
        self,
        task: str,
        write_set: WriteSetSpec,
        *,
        ttl_seconds: int | None = None,
        approval_timeout: float = 600.0,
    ) -> AsyncRunSession:
        """Create a run and wait up to `approval_timeout` s for its approval (see Airlock)."""
        run = await self._run(
            protocol.create_run(self.token, task, write_set_json(write_set), ttl_seconds)
        )
        assert run.token is not None
        session = AsyncRunSession(self, run, run.token)
        if approval_timeout > 0:
            await session.wait_for_approval(approval_timeout)
        return session

    async def join_run(self, run_token: str | None = None) -> AsyncRunSession:
        token = run_token or self.token
        return AsyncRunSession(self, await self._run(protocol.own_run(token)), token)

    async def get_run(self, run_id: str) -> Run:
        return await self._run(protocol.get_run(self.token, run_id))

    async def read(self, resource: str) -> Resource:
        return await self._run(protocol.read(self.token, resource))

    async def get_action(self, action_id: str) -> Action:
        return await self._run(protocol.get_action(self.token, action_id))

    async def wait_for_action(
        self,
        action: Action | str,
        *,
        timeout: float = 60.0,
        until: Callable[[Action], bool] | None = None,
    ) -> Action:
        action_id = action.id if isinstance(action, Action) else action
        return await self._run(protocol.wait_for_action(self.token, action_id, timeout, until))

    async def list_actions(self, run_id: str | None = None) -> list[Action]:
        return await self._run(protocol.list_actions(self.token, run_id))

    async def get_plan(self, plan_id: str) -> Plan:
        return await self._run(protocol.get_plan(self.token, plan_id))

    async def wait_for_plan(
        self,
        plan: Plan | str,
        *,
        timeout: float = 60.0,
        until: Callable[[Plan], bool] | None = None,
    ) -> Plan:
        """Long-poll until the plan is final (or `until(plan)`), at most `timeout`
        seconds; returns its latest state either way (check `.is_final`)."""
        plan_id = plan.id if isinstance(plan, Plan) else plan
        return await self._run(protocol.wait_for_plan(self.token, plan_id, timeout, until))

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncAirlock:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class AsyncRunSession:
    """One run (see RunSession): `async with` heartbeats while open, finishes on exit."""

    def __init__(self, client: AsyncAirlock, run: Run, token: str) -> None:
        self.client = client
        self.run = run
        self.token = token
        self._beat_task: asyncio.Task[None] | None = None
        self.heartbeat_error: Exception | None = None

    @property
    def id(self) -> str:
        return self.run.id

    async def _call(self, op: Op[T]) -> T:
        return await self.client._run(op)

    async def refresh(self) -> Run:
        self.run = await self._call(protocol.get_run(self.token, self.id))
        return self.run

    async def wait_for_approval(self, timeout: float = 600.0) -> Run:
        self.run = await self._call(protocol.wait_for_run(self.token, self.id, timeout))
        if not self.run.active:
            reason = f" ({self.run.status_reason})" if self.run.status_reason else ""
            raise RunNotApproved(f"run {self.id} is {self.run.status}{reason}", self.run)
        return self.run

    async def read(self, resource: str) -> Resource:
        return await self._call(protocol.read(self.token, resource))

    async def put(
        self,
        base: Resource,
        document: Any,
        *,
        reason: str | None = None,
        idempotency_key: str | None = None,
    ) -> Action:
        return await self._call(
            protocol.write(
                self.token,
                "PUT",
                base.identifier,
                precondition=("If-Match", base.etag),
                document=document,
                reason=reason,
                idempotency_key=idempotency_key,
            )
        )

    async def patch(
        self,
        base: Resource,
        patch: dict[str, Any],
        *,
        reason: str | None = None,
        idempotency_key: str | None = None,
    ) -> Action:
        return await self._call(
            protocol.write(
                self.token,
                "PATCH",
                base.identifier,
                precondition=("If-Match", base.etag),
                document=patch,
                reason=reason,
                idempotency_key=idempotency_key,
            )
        )

    async def delete(
        self, base: Resource, *, reason: str | None = None, idempotency_key: str | None = None
    ) -> Action:
        return await self._call(
            protocol.write(
                self.token,
                "DELETE",
                base.identifier,
                precondition=("If-Match", base.etag),
                reason=reason,
                idempotency_key=idempotency_key,
            )
        )

    async def create(
        self,
        resource: str,
        document: Any,
        *,
        reason: str | None = None,
        idempotency_key: str | None = None,
    ) -> Action:
        return await self._call(
            protocol.write(
                self.token,
                "PUT",
                resource,
                precondition=("If-None-Match", "*"),
                document=document,
                reason=reason,
                idempotency_key=idempotency_key,
            )
        )

    async def wait(
        self,
        action: Action | str,
        *,
        timeout: float = 60.0,
        until: Callable[[Action], bool] | None = None,
    ) -> Action:
        action_id = action.id if isinstance(action, Action) else action
        return await self._call(protocol.wait_for_action(self.token, action_id, timeout, until))

    async def undo(
        self,
        action: Action | str,
        *,
        idempotency_key: str | None = None,
        wait: float = 0.0,
    ) -> Action:
        action_id = action.id if isinstance(action, Action) else action
        accepted = await self._call(protocol.undo(self.token, action_id, idempotency_key))
        if wait <= 0:
            return accepted
        return await self.wait(action_id, timeout=wait, until=protocol.undo_settled)

    async def propose_plan(
        self,
        steps: Iterable[dict[str, Any]],
        *,
        reason: str = "",
        idempotency_key: str | None = None,
    ) -> Plan:
        """Propose several writes as one plan (build steps with `plan_step`): approved
        as one, applied in order, compensated in reverse if a step fails for good.
        Recorded whole or not at all; a refusal names its step (`error.step`)."""
        return await self._call(
            protocol.propose_plan(self.token, self.id, list(steps), reason, idempotency_key)
        )

    async def wait_for_plan(
        self,
        plan: Plan | str,
        *,
        timeout: float = 60.0,
        until: Callable[[Plan], bool] | None = None,
    ) -> Plan:
        plan_id = plan.id if isinstance(plan, Plan) else plan
        return await self._call(protocol.wait_for_plan(self.token, plan_id, timeout, until))

    async def actions(self) -> list[Action]:
        return await self._call(protocol.list_actions(self.token, self.id))

    async def heartbeat(self) -> Run:
        self.run = await self._call(protocol.heartbeat(self.token, self.id))
        return self.run

    async def finish(self) -> Run:
        self.run = await self._call(protocol.finish(self.token, self.id))
        return self.run

    def start_heartbeat(self, interval: float | None = None) -> None:
        if self._beat_task is None:
            every = interval or heartbeat_interval(self.run)
            self._beat_task = asyncio.get_running_loop().create_task(self._beat(every))

    async def _beat(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.heartbeat()
            except RunNotActive as exc:
                self.heartbeat_error = exc
                return
            except Exception as exc:  # keep beating: the next one may get through
                logger.warning("heartbeat of run %s failed: %s", self.id, exc)

    async def stop_heartbeat(self) -> None:
        if self._beat_task is not None:
            self._beat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat_task
            self._beat_task = None

    async def __aenter__(self) -> AsyncRunSession:
        if self.run.active:
            self.start_heartbeat()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop_heartbeat()
        if not self.run.ended:
            with contextlib.suppress(RunNotActive):
                await self.finish()
