"""The public methods of the clients, each defined once and without I/O.

Every method of `Airlock` / `AsyncAirlock` and of `RunSession` / `AsyncRunSession` is a
method here with a leading underscore that returns the operation (`_protocol.Op`); the
sync classes (`client.py`) run it to its answer with `blocking`, the async ones
(`aclient.py`) with `awaiting`, so the two surfaces cannot drift apart. What differs is
only the transport, `close`, and how the background heartbeat waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeAlias, TypeVar

import httpx

from airlock_client import _protocol as protocol
from airlock_client._protocol import Contention, Op, RetryPolicy, Until
from airlock_client.errors import RunNotActive, RunNotApproved, StaleVersion, StillContended
from airlock_client.models import Action, Plan, Resource, Run, WriteSetEntry

T = TypeVar("T")
logger = logging.getLogger("airlock_client")

WriteSetSpec = Iterable[WriteSetEntry | tuple[str, Sequence[str]] | dict[str, Any]]
#: `Airlock-Reason`, shown to the approvers (no secrets).
Reason: TypeAlias = str | None
#: An `Idempotency-Key` of your own; by default one is made per call.
Key: TypeAlias = str | None
#: The exception type `__exit__` receives.
ExcType: TypeAlias = type[BaseException] | None


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


def _id_of(entity: Action | Plan | str) -> str:
    return entity if isinstance(entity, str) else entity.id


class Reader:
    """What any token reads and waits for: an agent's (`Airlock`) or a run's."""

    token: str

    def _read(self, resource: str) -> Op[Resource]:
        """GET `kind/name`: the document and the ETag to condition a write on."""
        return protocol.read(self.token, resource)

    def _wait_for_action(
        self, action: Action | str, *, timeout: float = 60.0, until: Until[Action] = None
    ) -> Op[Action]:
        """Long-poll until the action is final (or `until(action)`), at most `timeout`
        seconds; returns its latest state either way (check `.final`)."""
        return protocol.wait_for_action(self.token, _id_of(action), timeout, until)

    def _wait_for_supersede(
        self, lost: StaleVersion | Resource | str, *, timeout: float = 60.0
    ) -> Op[Action | None]:
        """Wait until the approved write that replaces the version you read is final:
        the one a 412 (`StaleVersion`) or a read (`Resource.queued_action`) names, or
        its id. Returns its final state (or latest, after `timeout` seconds); None when
        nothing is queued or this token may not read it. Re-read after it."""
        queued = lost if isinstance(lost, str) else lost.queued_action
        if queued is None:
            return None
        return (yield from protocol.wait_for_supersede(self.token, queued, timeout))

    def _wait_for_plan(
        self, plan: Plan | str, *, timeout: float = 60.0, until: Until[Plan] = None
    ) -> Op[Plan]:
        """Long-poll until the plan is final (or `until(plan)`), at most `timeout`
        seconds; returns its latest state either way (check `.is_final`). A `superseded`
        plan (a person approved it with a step edited) is followed to the edited plan."""
        deadline = time.monotonic() + timeout
        found = yield from protocol.wait_for_plan(self.token, _id_of(plan), timeout, until)
        while found.status == "superseded" and found.superseded_by:  # each edit: a new plan
            left = deadline - time.monotonic()
            found = yield from protocol.wait_for_plan(self.token, found.superseded_by, left, until)
        return found


Session = TypeVar("Session", bound="SessionCore[Any]")
Http = TypeVar("Http", httpx.Client, httpx.AsyncClient)
Client = TypeVar("Client")


class AirlockCore(Reader, Generic[Session, Http]):
    """A connection to one Airlock server with one token (agent `ak_…` or run `rt_…`)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        retry_budget: float = 30.0,
        timeout: float = 30.0,
        http: Http | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.retry = RetryPolicy(budget=retry_budget)
        self.timeout = httpx.Timeout(timeout)
        self._http: Http = http or self._new_http()
        self._owns_http = http is None

    def _new_http(self) -> Http:
        raise NotImplementedError

    def _session(self, run: Run, token: str) -> Session:
        raise NotImplementedError

    def _whoami(self) -> Op[dict[str, Any]]:
        return protocol.whoami(self.token)

    def _start_run(
        self,
        task: str,
        write_set: WriteSetSpec,
        *,
        ttl_seconds: int | None = None,
        approval_timeout: float = 600.0,
        idempotency_key: Key = None,
    ) -> Op[Session]:
        """Create a run (agent token) and wait up to `approval_timeout` seconds for a
        person to approve it (long-poll). Raises RunNotApproved if it is rejected or
        still pending; `approval_timeout=0` returns the pending run at once. The
        run is created at most once per call, however often a lost answer is retried
        (one Idempotency-Key per call, or `idempotency_key`)."""
        run = yield from protocol.create_run(
            self.token, task, write_set_json(write_set), ttl_seconds, idempotency_key
        )
        assert run.token is not None
        session = self._session(run, run.token)
        if approval_timeout > 0:
            yield from session._wait_for_approval(approval_timeout)
        return session

    def _join_run(self, run_token: str | None = None) -> Op[Session]:
        """The run of a run token (this client's token when none is given)."""
        token = run_token or self.token
        return self._session((yield from protocol.own_run(token)), token)

    def _get_run(self, run_id: str) -> Op[Run]:
        return protocol.get_run(self.token, run_id)

    def _get_action(self, action_id: str) -> Op[Action]:
        return protocol.get_action(self.token, action_id)

    def _list_actions(self, run_id: str | None = None) -> Op[list[Action]]:
        return protocol.list_actions(self.token, run_id)

    def _get_plan(self, plan_id: str) -> Op[Plan]:
        return protocol.get_plan(self.token, plan_id)


class SessionCore(Reader, Generic[Client]):
    """One run: reads and writes with its run token. As a context manager it
    heartbeats in the background while open and finishes the run on exit."""

    def __init__(self, client: Client, run: Run, token: str) -> None:
        self.client = client
        self.run = run
        self.token = token
        #: Set when the background heartbeat learnt the run is no longer active.
        self.heartbeat_error: Exception | None = None

    @property
    def id(self) -> str:
        return self.run.id

    def _refresh(self) -> Op[Run]:
        self.run = yield from protocol.get_run(self.token, self.id)
        return self.run

    def _wait_for_approval(self, timeout: float = 600.0) -> Op[Run]:
        """Long-poll the run until a person decided; raises RunNotApproved unless active."""
        self.run = yield from protocol.wait_for_run(self.token, self.id, timeout)
        if not self.run.active:
            reason = f" ({self.run.status_reason})" if self.run.status_reason else ""
            raise RunNotApproved(f"run {self.id} is {self.run.status}{reason}", self.run)
        return self.run

    def _put(
        self, base: Resource, document: Any, *, reason: Reason = None, idempotency_key: Key = None
    ) -> Op[Action]:
        """Replace the document of `base` (what you read), conditioned on its ETag."""
        return self._write("PUT", base, document, reason, idempotency_key)

    def _patch(
        self,
        base: Resource,
        patch: dict[str, Any],
        *,
        reason: Reason = None,
        idempotency_key: Key = None,
    ) -> Op[Action]:
        """JSON merge patch (RFC 7396) of `base`, conditioned on its ETag."""
        return self._write("PATCH", base, patch, reason, idempotency_key)

    def _delete(
        self, base: Resource, *, reason: Reason = None, idempotency_key: Key = None
    ) -> Op[Action]:
        return self._write("DELETE", base, None, reason, idempotency_key)

    def _create(
        self, resource: str, document: Any, *, reason: Reason = None, idempotency_key: Key = None
    ) -> Op[Action]:
        """Create `kind/name` (If-None-Match: *): refused if it already exists."""
        return self._write("PUT", resource, document, reason, idempotency_key)

    def _write(
        self, method: str, target: Resource | str, document: Any, reason: Reason, key: Key
    ) -> Op[Action]:
        """A write of what was read (If-Match: its ETag), or a create of `kind/name`."""
        if isinstance(target, str):
            identifier, precondition = target, ("If-None-Match", "*")
        else:
            identifier, precondition = target.identifier, ("If-Match", target.etag)
        return protocol.write(
            self.token,
            method,
            identifier,
            precondition=precondition,
            document=document,
            reason=reason,
            idempotency_key=key,
        )

    def _update(
        self,
        resource: str,
        change: Callable[[Resource], dict[str, Any] | None],
        *,
        reason: Reason = None,
        attempts: int = 20,
        timeout: float = 300.0,
        contention: Contention | None = None,
    ) -> Op[Action | None]:
        """Read `kind/name` → `change(resource)` (a JSON merge patch, or None: nothing
        to do) → PATCH conditioned on what was read → wait until final (`timeout`).

        A lost race starts again from the read, the way a well-behaved agent on a busy
        resource does: when the read (`Resource.queued_action`) or the 412 names an
        approved write already queued over the version read, it waits for that write
        instead of proposing; after every loss it backs off (`Contention`, full
        jitter doubling per loss) before reading again. A conflict at execution the
        agent may retry counts as a loss too. Returns the final action (or its latest
        state after `timeout`), None when `change` returned None; raises
        StillContended after `attempts` losses in a row."""
        pace = contention or Contention()
        for losses in range(attempts):
            current = yield from protocol.read(self.token, resource, pace.delay(losses))
            queued = current.queued_action
            if queued is None:
                patch = change(current)
                if patch is None:
                    return None
                outcome = yield from protocol.write_or_stale(
                    self.token,
                    "PATCH",
                    current.identifier,
                    precondition=("If-Match", current.etag),
                    document=patch,
                    reason=reason,
                )
                if isinstance(outcome, StaleVersion):
                    queued = outcome.queued_action
                else:
                    action = yield from protocol.wait_for_action(self.token, outcome.id, timeout)
                    if not (action.status == "conflict" and action.retryable_by_agent):
                        return action
            if queued is not None:
                yield from protocol.wait_for_supersede(self.token, queued, timeout)
        raise StillContended(resource, attempts)

    def _undo(
        self, action: Action | str, *, idempotency_key: Key = None, wait: float = 0.0
    ) -> Op[Action]:
        """Ask for the undo (202); with `wait` > 0, long-poll until it settled."""
        action_id = _id_of(action)
        accepted = yield from protocol.undo(self.token, action_id, idempotency_key)
        if wait <= 0:
            return accepted
        until = protocol.undo_settled
        return (yield from protocol.wait_for_action(self.token, action_id, wait, until))

    def _propose_plan(
        self, steps: Iterable[dict[str, Any]], *, reason: str = "", idempotency_key: Key = None
    ) -> Op[Plan]:
        """Propose several writes as one plan (build steps with `plan_step`): approved
        as one, applied in order, compensated in reverse if a step fails for good.
        Recorded whole or not at all; a refusal names its step (`error.step`)."""
        return protocol.propose_plan(self.token, self.id, list(steps), reason, idempotency_key)

    def _actions(self) -> Op[list[Action]]:
        return protocol.list_actions(self.token, self.id)

    def _heartbeat(self) -> Op[Run]:
        self.run = yield from protocol.heartbeat(self.token, self.id)
        return self.run

    def _finish(self) -> Op[Run]:
        self.run = yield from protocol.finish(self.token, self.id)
        return self.run

    def _keeps_beating(self, failure: Exception) -> bool:
        """After a failed background heartbeat: stop once the run is no longer active
        (kept in `heartbeat_error`); otherwise keep beating: the next may get through."""
        if isinstance(failure, RunNotActive):
            self.heartbeat_error = failure
            return False
        logger.warning("heartbeat of run %s failed: %s", self.id, failure)
        return True
