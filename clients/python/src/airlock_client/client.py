"""The synchronous client: `Airlock` (one per server + token) and `RunSession` (one run).

from airlock_client import Airlock, StaleVersion

with Airlock("http://127.0.0.1:8000", agent_token) as airlock:
    with airlock.start_run("add a backup destination",
                           [("notification-policy/prod-alerts", ["update"])]) as run:
        policy = run.read("notification-policy/prod-alerts")
        action = run.patch(policy, {"destinations": [...]}, reason="why")
        action = run.wait(action, timeout=300)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx

from airlock_client import _protocol as protocol
from airlock_client._protocol import Call, Op, RetryPolicy
from airlock_client.errors import RunNotActive, RunNotApproved
from airlock_client.models import Action, Plan, Resource, Run, WriteSetEntry

T = TypeVar("T")
logger = logging.getLogger("airlock_client")

USER_AGENT = "airlock-client/0.1 (python)"

WriteSetSpec = Iterable[WriteSetEntry | tuple[str, Sequence[str]] | dict[str, Any]]


def write_set_json(write_set: WriteSetSpec) -> list[dict[str, Any]]:
    """Accepts WriteSetEntry, ("kind/name", ["update"]) pairs or the API's dicts."""
    entries: list[dict[str, Any]] = []
    for entry in write_set:
        if isinstance(entry, WriteSetEntry):
            entries.append(entry.as_json())
        elif isinstance(entry, dict):
            entries.append(dict(entry))
        else:
            resource, operations = entry
            entries.append({"resource": resource, "operations": list(operations)})
    return entries


def heartbeat_interval(run: Run) -> float:
    """A third of the run's TTL (at least 5 s), so two missed beats still keep it alive."""
    ttl = run.raw.get("ttl_seconds")
    return max(5.0, float(ttl) / 3) if isinstance(ttl, int | float) else 60.0


class Airlock:
    """A connection to one Airlock server with one token (agent `ak_…` or run `rt_…`)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        retry_budget: float = 30.0,
        timeout: float = 30.0,
        http: httpx.Client | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry = RetryPolicy(budget=retry_budget)
        self.timeout = httpx.Timeout(timeout)
        self._http = http or httpx.Client(base_url=self.base_url, timeout=self.timeout)
        self._owns_http = http is None

    # --- driving the protocol ---------------------------------------------------------

    def _send(self, call: Call) -> httpx.Response:
        attempts = protocol.Attempts(call, self.retry)
        while True:
            try:
                response = self._http.request(
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
            time.sleep(delay)

    def _run(self, op: Op[T]) -> T:
        try:
            call = next(op)
            while True:
                call = op.send(self._send(call))
        except StopIteration as stop:
            result: T = stop.value
            return result

    # --- the surface --------------------------------------------------------------------

    def whoami(self) -> dict[str, Any]:
        return self._run(protocol.whoami(self.token))

    def start_run(
        self,
        task: str,
        write_set: WriteSetSpec,
        *,
        ttl_seconds: int | None = None,
        approval_timeout: float = 600.0,
    ) -> RunSession:
        """Create a run (agent token) and wait up to `approval_timeout` seconds for a
        person to approve it (long-poll). Raises RunNotApproved if it is rejected or
        still pending; `approval_timeout=0` returns the pending run at once."""
        run = self._run(
            protocol.create_run(self.token, task, write_set_json(write_set), ttl_seconds)
        )
        assert run.token is not None
        session = RunSession(self, run, run.token)
        if approval_timeout > 0:
            session.wait_for_approval(approval_timeout)
        return session

    def join_run(self, run_token: str | None = None) -> RunSession:
        """The run of a run token (this client's token when none is given)."""
        token = run_token or self.token
        return RunSession(self, self._run(protocol.own_run(token)), token)

    def get_run(self, run_id: str) -> Run:
        return self._run(protocol.get_run(self.token, run_id))

    def read(self, resource: str) -> Resource:
        """GET `kind/name`: the document and the ETag to condition a write on."""
        return self._run(protocol.read(self.token, resource))

    def get_action(self, action_id: str) -> Action:
        return self._run(protocol.get_action(self.token, action_id))

    def wait_for_action(
        self,
        action: Action | str,
        *,
        timeout: float = 60.0,
        until: Callable[[Action], bool] | None = None,
    ) -> Action:
        """Long-poll until the action is final (or `until(action)`), at most `timeout`
        seconds; returns its latest state either way (check `.final`)."""
        action_id = action.id if isinstance(action, Action) else action
        return self._run(protocol.wait_for_action(self.token, action_id, timeout, until))

    def list_actions(self, run_id: str | None = None) -> list[Action]:
        return self._run(protocol.list_actions(self.token, run_id))

    def get_plan(self, plan_id: str) -> Plan:
        return self._run(protocol.get_plan(self.token, plan_id))

    def wait_for_plan(
        self,
        plan: Plan | str,
        *,
        timeout: float = 60.0,
        until: Callable[[Plan], bool] | None = None,
    ) -> Plan:
        """Long-poll until the plan is final (or `until(plan)`), at most `timeout`
        seconds; returns its latest state either way (check `.is_final`)."""
        plan_id = plan.id if isinstance(plan, Plan) else plan
        return self._run(protocol.wait_for_plan(self.token, plan_id, timeout, until))

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Airlock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RunSession:
    """One run: reads and writes with its run token. As a context manager it
    heartbeats in the background while open and finishes the run on exit."""

    def __init__(self, client: Airlock, run: Run, token: str) -> None:
        self.client = client
        self.run = run
        self.token = token
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        #: Set when the background heartbeat learnt the run is no longer active.
        self.heartbeat_error: Exception | None = None

    @property
    def id(self) -> str:
        return self.run.id

    def _call(self, op: Op[T]) -> T:
        return self.client._run(op)

    def refresh(self) -> Run:
        self.run = self._call(protocol.get_run(self.token, self.id))
        return self.run

    def wait_for_approval(self, timeout: float = 600.0) -> Run:
        """Long-poll the run until a person decided; raises RunNotApproved unless active."""
        self.run = self._call(protocol.wait_for_run(self.token, self.id, timeout))
        if not self.run.active:
            reason = f" ({self.run.status_reason})" if self.run.status_reason else ""
            raise RunNotApproved(f"run {self.id} is {self.run.status}{reason}", self.run)
        return self.run

    def read(self, resource: str) -> Resource:
        return self._call(protocol.read(self.token, resource))

    def put(
        self,
        base: Resource,
        document: Any,
        *,
        reason: str | None = None,
        idempotency_key: str | None = None,
    ) -> Action:
        """Replace the document of `base` (what you read), conditioned on its ETag."""
        return self._call(
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

    def patch(
        self,
        base: Resource,
        patch: dict[str, Any],
        *,
        reason: str | None = None,
        idempotency_key: str | None = None,
    ) -> Action:
        """JSON merge patch (RFC 7396) of `base`, conditioned on its ETag."""
        return self._call(
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

    def delete(
        self, base: Resource, *, reason: str | None = None, idempotency_key: str | None = None
    ) -> Action:
        return self._call(
            protocol.write(
                self.token,
                "DELETE",
                base.identifier,
                precondition=("If-Match", base.etag),
                reason=reason,
                idempotency_key=idempotency_key,
            )
        )

    def create(
        self,
        resource: str,
        document: Any,
        *,
        reason: str | None = None,
        idempotency_key: str | None = None,
    ) -> Action:
        """Create `kind/name` (If-None-Match: *): refused if it already exists."""
        return self._call(
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

    def wait(
        self,
        action: Action | str,
        *,
        timeout: float = 60.0,
        until: Callable[[Action], bool] | None = None,
    ) -> Action:
        action_id = action.id if isinstance(action, Action) else action
        return self._call(protocol.wait_for_action(self.token, action_id, timeout, until))

    def undo(
        self,
        action: Action | str,
        *,
        idempotency_key: str | None = None,
        wait: float = 0.0,
    ) -> Action:
        """Ask for the undo (202); with `wait` > 0, long-poll until it settled."""
        action_id = action.id if isinstance(action, Action) else action
        accepted = self._call(protocol.undo(self.token, action_id, idempotency_key))
        if wait <= 0:
            return accepted
        return self.wait(action_id, timeout=wait, until=protocol.undo_settled)

    def propose_plan(
        self,
        steps: Iterable[dict[str, Any]],
        *,
        reason: str = "",
        idempotency_key: str | None = None,
    ) -> Plan:
        """Propose several writes as one plan (build steps with `plan_step`): approved
        as one, applied in order, compensated in reverse if a step fails for good.
        Recorded whole or not at all; a refusal names its step (`error.step`)."""
        return self._call(
            protocol.propose_plan(self.token, self.id, list(steps), reason, idempotency_key)
        )

    def wait_for_plan(
        self,
        plan: Plan | str,
        *,
        timeout: float = 60.0,
        until: Callable[[Plan], bool] | None = None,
    ) -> Plan:
        plan_id = plan.id if isinstance(plan, Plan) else plan
        return self._call(protocol.wait_for_plan(self.token, plan_id, timeout, until))

    def actions(self) -> list[Action]:
        return self._call(protocol.list_actions(self.token, self.id))

    def heartbeat(self) -> Run:
        self.run = self._call(protocol.heartbeat(self.token, self.id))
        return self.run

    def finish(self) -> Run:
        self.run = self._call(protocol.finish(self.token, self.id))
        return self.run

    # --- background heartbeat --------------------------------------------------------------

    def start_heartbeat(self, interval: float | None = None) -> None:
        if self._beat_thread is not None:
            return
        every = interval or heartbeat_interval(self.run)
        self._beat_stop.clear()
        self._beat_thread = threading.Thread(
            target=self._beat, args=(every,), name=f"airlock-heartbeat-{self.id}", daemon=True
        )
        self._beat_thread.start()

    def _beat(self, every: float) -> None:
        while not self._beat_stop.wait(every):
            try:
                self.heartbeat()
            except RunNotActive as exc:
                self.heartbeat_error = exc
                return
            except Exception as exc:  # keep beating: the next one may get through
                logger.warning("heartbeat of run %s failed: %s", self.id, exc)

    def stop_heartbeat(self) -> None:
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=5)
            self._beat_thread = None

    def __enter__(self) -> RunSession:
        if self.run.active:
            self.start_heartbeat()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_heartbeat()
        if not self.run.ended:
            with contextlib.suppress(RunNotActive):
                self.finish()
