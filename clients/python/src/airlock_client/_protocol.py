"""The protocol, without I/O: what to send, how to read the answer, when to retry.

Each API operation is a generator that yields `Call`s and receives the final
`httpx.Response` of each; `Exchange` runs one operation with the retry rules, and the
sync and async clients only send its requests and sleep its delays, so both have
exactly the same behaviour.
"""

from __future__ import annotations

import email.utils
import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, ParamSpec, Protocol, TypeAlias, TypeVar
from urllib.parse import quote

import httpx

from airlock_client._paths import API_PREFIX as API_PREFIX
from airlock_client._paths import action_path, plan_path, run_path, uuid_id
from airlock_client._paths import resource_path as resource_path
from airlock_client.errors import ProblemError, StaleVersion, TransportFailed, problem_error
from airlock_client.models import Action, Plan, Resource, Run

T = TypeVar("T")
P = ParamSpec("P")
logger = logging.getLogger("airlock_client")

USER_AGENT = "airlock-client/0.1 (python)"
#: The server holds a long-poll at most this long (Prefer: wait=N, N ≤ 60).
MAX_SERVER_WAIT = 60
#: Statuses that a proxy may answer without a problem body and that are worth a retry.
_GATEWAY_STATUSES = frozenset({502, 503, 504})


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    token: str
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    #: A long-poll's own hold time: the read timeout is this plus a margin.
    hold_seconds: float | None = None
    #: May the identical request be sent again when it may already have taken effect
    #: (a broken connection, a read timeout, a 5xx that may have come after COMMIT)?
    #: True for reads, for requests carrying an Idempotency-Key (the server replays the
    #: first answer: writes, undo, plans, POST /runs) and for idempotent verbs
    #: (heartbeat, finish).
    replay_safe: bool = True
    #: Seconds to wait before the first attempt (a back-off the operation chose).
    delay: float = 0.0
    #: Error statuses the operation reads itself instead of raising their error.
    accept: frozenset[int] = frozenset()


Op = Generator[Call, httpx.Response, T]
#: When a wait may stop early (besides its default).
Until: TypeAlias = Callable[[T], bool] | None


@dataclass(frozen=True)
class Contention:
    """How an agent that lost the race for a resource paces its next read: a random
    delay (full jitter) whose bound doubles with each consecutive loss, up to `cap`.
    Many agents looping on one resource then do not all read and propose again the
    moment the winner's write lands (only one of them can win the next round, and
    every refused proposal is a write the server audits)."""

    base: float = 0.5
    cap: float = 4.0

    def delay(self, losses: int) -> float:
        """Before the read that follows the `losses`-th loss in a row (0: at once)."""
        if losses <= 0:
            return 0.0
        return random.uniform(0, min(self.cap, self.base * 2 ** (losses - 1)))


@dataclass(frozen=True)
class RetryPolicy:
    """What is retried, with exponential backoff and full jitter, honouring Retry-After,
    while the next attempt would start within `budget` seconds of the first:

    - a retryable refusal (`retryable: true` below 500: 429, 409 key in flight, 423
      leased), which the server answers before acting: any request;
    - a retryable 5xx (503 `unavailable`, `transient_conflict`, 500), a gateway's
      502/503/504, a broken connection or a read timeout: only a replay-safe request
      (`Call.replay_safe`), since it may come after the server committed.

    Nothing else is ever retried."""

    budget: float = 30.0
    base: float = 0.25
    cap: float = 8.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return retry_after + random.uniform(0, min(1.0, 0.1 * retry_after + 0.05))
        return random.uniform(0, min(self.cap, self.base * (2**attempt)))


def new_idempotency_key() -> str:
    return f"airlock-{uuid.uuid4().hex}"


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def error_for(response: httpx.Response) -> ProblemError:
    try:
        body: Any = response.json()
    except ValueError:
        body = {"detail": response.text[:500], "title": response.reason_phrase}
    return problem_error(
        response.status_code,
        body,
        retry_after=parse_retry_after(response.headers.get("Retry-After")),
        request_id=response.headers.get("X-Request-Id"),
    )


@dataclass(frozen=True)
class Request:
    """One HTTP request for a driver to send, after sleeping `delay` seconds."""

    delay: float
    method: str
    url: str
    headers: dict[str, str]
    content: bytes | None
    timeout: httpx.Timeout

    def build(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        return http.build_request(
            self.method, self.url, headers=self.headers, content=self.content, timeout=self.timeout
        )


class Exchange(Generic[T]):
    """One operation's exchange with the server, without I/O (both drivers run it):
    the driver sends `request` (after its delay) and hands back the response (`answer`)
    or the broken connection (`broken`) until `request` is None; `result` is then the
    operation's answer. Each `Call` is resent, identical, while `RetryPolicy` allows;
    otherwise the typed error is raised."""

    def __init__(
        self, op: Op[T], base_url: str, policy: RetryPolicy, timeout: httpx.Timeout
    ) -> None:
        self._op = op
        self._base_url = base_url
        self._policy = policy
        self._timeout = timeout
        self.request: Request | None = None
        self._proceed(None)

    def _proceed(self, response: httpx.Response | None) -> None:
        """Hand the operation the answer to its call; its next call, or its result."""
        try:
            call = next(self._op) if response is None else self._op.send(response)
        except StopIteration as stop:
            self.request = None
            self.result: T = stop.value
            return
        self._call = call
        self._attempt = 0
        self._deadline = time.monotonic() + call.delay + self._policy.budget
        self._send_after(call.delay)

    def _send_after(self, delay: float) -> None:
        call = self._call
        headers = {
            "Authorization": f"Bearer {call.token}",
            "Accept": "application/json",
            "User-Agent": USER_AGENT,
            **call.headers,
        }
        timeout = self._timeout
        if call.hold_seconds is not None:  # a long-poll: read for its hold plus a margin
            timeout = httpx.Timeout(
                connect=timeout.connect,
                read=call.hold_seconds + 15.0,
                write=timeout.write,
                pool=timeout.pool,
            )
        url = self._base_url + call.path
        self.request = Request(delay, call.method, url, headers, call.content, timeout)

    def _retry(self, delay: float, why: object) -> bool:
        """Resend after `delay` if that still starts within the budget."""
        if time.monotonic() + delay > self._deadline:
            return False
        logger.info("retrying %s %s in %.2fs: %s", self._call.method, self._call.path, delay, why)
        self._attempt += 1
        self._send_after(delay)
        return True

    def answer(self, response: httpx.Response) -> None:
        if response.status_code < 400 or response.status_code in self._call.accept:
            self._proceed(response)
            return
        error = error_for(response)
        # A refusal (< 500) was decided before anything happened; a 5xx may have come
        # after COMMIT (the connection to the database lost while committing), so it is
        # resent only when the server would replay the first answer instead of acting again.
        before_acting = response.status_code < 500
        retryable = (error.retryable and (before_acting or self._call.replay_safe)) or (
            self._call.replay_safe
            and response.status_code in _GATEWAY_STATUSES
            and not error.problem_code
        )
        delay = self._policy.delay(self._attempt, error.retry_after)
        if not (retryable and self._retry(delay, response.status_code)):
            raise error

    def broken(self, exc: httpx.TransportError) -> None:
        """A broken connection: resend only a replay-safe request (same headers, so
        the same Idempotency-Key); otherwise nobody knows whether it happened."""
        detail = f"{self._call.method} {self._call.path}: {type(exc).__name__}: {exc}"
        if not self._call.replay_safe:
            raise TransportFailed(
                f"{detail} (not retried: the request may or may not have taken effect)"
            ) from exc
        if not self._retry(self._policy.delay(self._attempt, None), exc):
            raise TransportFailed(f"{detail} (retry budget spent)") from exc


# --- Operations ---------------------------------------------------------------------


def _json(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    if not isinstance(body, dict):
        raise TransportFailed(f"expected a JSON object, got {type(body).__name__}")
    return body


class _Tagged(Protocol):
    @property
    def etag(self) -> str | None: ...


Tagged = TypeVar("Tagged", bound=_Tagged)


def _get(token: str, path: str, parse: Callable[[httpx.Response], T]) -> Op[T]:
    return parse((yield Call("GET", path, token)))


def _long_poll(
    token: str,
    path: str,
    parse: Callable[[httpx.Response], Tagged],
    wanted: Callable[[Tagged], bool],
    timeout: float,
    current: Tagged | None = None,
) -> Op[Tagged]:
    """GET `path` (unless `current` was just read), then long-poll it (Prefer: wait,
    If-None-Match: its ETag) until `wanted` or `timeout` seconds pass; answers the
    last state either way."""
    if current is None:
        current = yield from _get(token, path, parse)
    deadline = time.monotonic() + timeout
    while not wanted(current):
        remaining = deadline - time.monotonic()
        if remaining < 1:
            break
        hold = min(MAX_SERVER_WAIT, int(remaining))
        headers = {"Prefer": f"wait={hold}"}
        if current.etag:
            headers["If-None-Match"] = current.etag
        response = yield Call("GET", path, token, headers, None, hold)
        if response.status_code == 200:
            current = parse(response)
    return current


def whoami(token: str) -> Op[dict[str, Any]]:
    response = yield Call("GET", f"{API_PREFIX}/whoami", token)
    return _json(response)


def create_run(
    token: str,
    task: str,
    write_set: list[dict[str, Any]],
    ttl_seconds: int | None,
    idempotency_key: str | None = None,
) -> Op[Run]:
    """POST /runs with an Idempotency-Key made once here: every retry (a lost answer, a
    503 after COMMIT) is the identical request, and the server answers it with the run
    it created first, never a second one."""
    body: dict[str, Any] = {"task": task, "write_set": write_set}
    if ttl_seconds is not None:
        body["ttl_seconds"] = ttl_seconds
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": idempotency_key or new_idempotency_key(),
    }
    response = yield Call("POST", f"{API_PREFIX}/runs", token, headers, json.dumps(body).encode())
    return _parse_run(response)


def _parse_run(response: httpx.Response) -> Run:
    return Run.from_json(_json(response), response.headers.get("ETag"))


def get_run(token: str, run_id: str) -> Op[Run]:
    return _get(token, run_path(run_id), _parse_run)


def own_run(token: str) -> Op[Run]:
    """The run a run token belongs to (GET /runs with a run token lists only it)."""
    response = yield Call("GET", f"{API_PREFIX}/runs?limit=1", token)
    items = _json(response).get("items") or []
    if not items:
        raise TransportFailed("GET /runs listed no run for this token: is it a run token?")
    return Run.from_json(items[0])


def wait_for_run(token: str, run_id: str, timeout: float, until: Until[Run] = None) -> Op[Run]:
    """Long-poll the run until `until(run)` (default: no longer pending approval) or
    `timeout` seconds; answers the last state either way."""
    path, wanted = run_path(run_id), until or (lambda run: not run.pending)
    return _long_poll(token, path, _parse_run, wanted, timeout)


def heartbeat(token: str, run_id: str) -> Op[Run]:
    return _parse_run((yield Call("POST", run_path(run_id, "heartbeat"), token)))


def finish(token: str, run_id: str) -> Op[Run]:
    return _parse_run((yield Call("POST", run_path(run_id, "finish"), token)))


def read(token: str, resource: str, delay: float = 0.0) -> Op[Resource]:
    response = yield Call("GET", resource_path(resource), token, delay=delay)
    return Resource.from_json(
        _json(response), response.headers.get("ETag"), response.headers.get(QUEUED_ACTION)
    )


#: On a read: the approved write already queued to replace the version read.
QUEUED_ACTION = "Airlock-Queued-Action"


def write_or_stale(
    token: str,
    method: str,
    resource: str,
    *,
    precondition: tuple[str, str],
    document: Any = None,
    reason: str | None = None,
    idempotency_key: str | None = None,
) -> Op[Action | StaleVersion]:
    """PUT/PATCH/DELETE one resource. `precondition` is (`If-Match`, the ETag read) or
    (`If-None-Match`, `*`) to create. The Idempotency-Key is made once here, so every
    retry of this write (after a broken connection, 429, 503 or 409 in flight) is the
    identical request and the server answers it at most once. A 412 is answered as its
    `StaleVersion` (a lost race is an outcome the caller handles; `write` raises it);
    every other error is raised."""
    headers = {
        precondition[0]: precondition[1],
        "Idempotency-Key": idempotency_key or new_idempotency_key(),
    }
    if reason:
        headers["Airlock-Reason"] = reason
    content = None
    if method != "DELETE":
        headers["Content-Type"] = (
            "application/merge-patch+json" if method == "PATCH" else "application/json"
        )
        content = json.dumps(document).encode()
    response = yield Call(method, resource_path(resource), token, headers, content, accept=_STALE)
    if response.status_code == 412:
        stale = error_for(response)
        assert isinstance(stale, StaleVersion)
        return stale
    return Action.from_json(
        _json(response), replayed=response.headers.get("Idempotent-Replayed") == "true"
    )


_STALE = frozenset({412})


def _raising_stale(op: Callable[P, Op[Action | StaleVersion]]) -> Callable[P, Op[Action]]:
    """The same operation, with a lost race (412) raised as its `StaleVersion`."""

    def raising(*args: P.args, **kwargs: P.kwargs) -> Op[Action]:
        outcome = yield from op(*args, **kwargs)
        if isinstance(outcome, StaleVersion):
            raise outcome
        return outcome

    return raising


#: `write_or_stale`, raising a 412 as `StaleVersion`.
write = _raising_stale(write_or_stale)
_NOT_VISIBLE = frozenset({404})


def get_action(token: str, action_id: str) -> Op[Action]:
    return _get(token, action_path(action_id), _parse_action)


def _parse_action(response: httpx.Response) -> Action:
    action = Action.from_json(_json(response))
    etag = response.headers.get("ETag")
    if etag and etag != action.etag:
        action = Action.from_json({**action.raw, "etag": etag})
    return action


def wait_for_action(
    token: str, action_id: str, timeout: float, until: Until[Action] = None
) -> Op[Action]:
    """Long-poll the action until `until(action)` (default: final; a `superseded` one is
    followed to its edited action) or `timeout` seconds pass; answers the last state."""
    wanted, deadline = until or (lambda action: action.final), time.monotonic() + timeout
    action = yield from _long_poll(token, action_path(action_id), _parse_action, wanted, timeout)
    while action.status == "superseded" and action.superseded_by:  # each edit: a new action
        path, left = action_path(action.superseded_by), deadline - time.monotonic()
        action = yield from _long_poll(token, path, _parse_action, wanted, left)
    return action


def wait_for_supersede(token: str, action_id: str, timeout: float) -> Op[Action | None]:
    """Long-poll the approved write that replaces the version you read (a 412's or a
    read's `queued_action`) until it is final or `timeout` seconds pass. None when this
    token may not read it (another agent's action): re-read after your back-off."""
    path = action_path(action_id)
    # Without If-None-Match the server holds the first read until the action is final.
    hold = max(1, min(MAX_SERVER_WAIT, int(timeout)))
    headers = {"Prefer": f"wait={hold}"}
    first = yield Call("GET", path, token, headers, None, hold, accept=_NOT_VISIBLE)
    if first.status_code == 404:
        return None
    final: Callable[[Action], bool] = lambda action: action.final  # noqa: E731
    return (yield from _long_poll(token, path, _parse_action, final, timeout, _parse_action(first)))


def list_actions(token: str, run_id: str | None, limit: int = 200) -> Op[list[Action]]:
    actions: list[Action] = []
    cursor = ""
    run = f"&run={uuid_id(run_id, 'run id')}" if run_id is not None else ""
    while True:
        query = f"limit={limit}{run}"
        if cursor:
            query += f"&cursor={quote(cursor, safe='')}"
        response = yield Call("GET", f"{API_PREFIX}/actions?{query}", token)
        page = _json(response)
        actions += [Action.from_json(item) for item in page.get("items") or []]
        cursor = str(page.get("next") or "")
        if not cursor or len(actions) >= 1000:
            return actions


def undo(token: str, action_id: str, idempotency_key: str | None = None) -> Op[Action]:
    headers = {"Idempotency-Key": idempotency_key or new_idempotency_key()}
    response = yield Call("POST", action_path(action_id, "undo"), token, headers)
    return _parse_action(response)


def undo_settled(action: Action) -> bool:
    """An undo has reached its end: the action is undone, or the undo itself became a
    conflict for a person, or failed."""
    if action.status == "undone":
        return True
    status = (action.undo or {}).get("status")
    return bool((action.undo or {}).get("conflict_id")) or status in ("failed", "undone")


# --- Plans ---------------------------------------------------------------------------

_BODY_OF = {"PUT": "document", "PATCH": "patch", "DELETE": None}


def plan_step(
    resource: Resource | str,
    method: str,
    *,
    etag: str | None = None,
    document: Any = None,
    patch: dict[str, Any] | None = None,
    create: bool = False,
    compensation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One step of a plan, as the API takes it: a conditional write like `write`.

    `resource` is what you read (its ETag becomes `if_match`) or `kind/name` with
    `etag`; `create=True` (with PUT) sends `if_none_match: *` instead. PUT takes
    `document`, PATCH a merge `patch`, DELETE neither. `compensation` (optional:
    {"method", "document"|"patch"}) replaces the default, the undo of the step.
    Raises ValueError for a step the server would refuse for its shape alone."""
    identifier = resource if isinstance(resource, str) else resource.identifier
    resource_path(identifier)  # the same 'kind/name' check as a single write
    if method not in _BODY_OF:
        raise ValueError(f"method must be PUT, PATCH or DELETE, got {method!r}")
    body: dict[str, Any] = {"resource": identifier, "method": method}
    if create:
        if method != "PUT":
            raise ValueError("a create is a PUT")
        body["if_none_match"] = "*"
    else:
        tag = etag or (None if isinstance(resource, str) else resource.etag)
        if not tag:
            raise ValueError(f"{identifier}: an update or delete needs the ETag you read")
        body["if_match"] = tag
    given = {"document": document, "patch": patch}
    needs = _BODY_OF[method]
    for name, value in given.items():
        if (value is not None) != (name == needs):
            raise ValueError(
                f"{method} needs {name}" if value is None else f"{method} takes no {name}"
            )
    if needs:
        body[needs] = given[needs]
    if compensation is not None:
        body["compensation"] = dict(compensation)
    return body


def propose_plan(
    token: str,
    run_id: str,
    steps: list[dict[str, Any]],
    reason: str = "",
    idempotency_key: str | None = None,
) -> Op[Plan]:
    """POST the whole plan; it is recorded whole or not at all. The Idempotency-Key is
    made once here (as for `write`), so every retry is the identical request and the
    server records the plan at most once."""
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": idempotency_key or new_idempotency_key(),
    }
    content = json.dumps({"reason": reason, "steps": steps}).encode()
    response = yield Call("POST", run_path(run_id, "plans"), token, headers, content)
    return Plan.from_json(
        _json(response),
        response.headers.get("ETag"),
        replayed=response.headers.get("Idempotent-Replayed") == "true",
    )


def _parse_plan(response: httpx.Response) -> Plan:
    return Plan.from_json(_json(response), response.headers.get("ETag"))


def get_plan(token: str, plan_id: str) -> Op[Plan]:
    return _get(token, plan_path(plan_id), _parse_plan)


def wait_for_plan(token: str, plan_id: str, timeout: float, until: Until[Plan] = None) -> Op[Plan]:
    """Long-poll the plan until `until(plan)` (default: a final state) or `timeout`
    seconds pass; answers the last state either way (check `.is_final`)."""
    path, wanted = plan_path(plan_id), until or (lambda plan: plan.is_final)
    return _long_poll(token, path, _parse_plan, wanted, timeout)


#: Every (method, path template) the client sends; the tests check them against the
#: served OpenAPI document.
ENDPOINTS: tuple[tuple[str, str], ...] = (
    ("GET", "/api/v1/whoami"),
    ("POST", "/api/v1/runs"),
    ("GET", "/api/v1/runs"),
    ("GET", "/api/v1/runs/{run_id}"),
    ("POST", "/api/v1/runs/{run_id}/heartbeat"),
    ("POST", "/api/v1/runs/{run_id}/finish"),
    ("GET", "/api/v1/resources/{kind}/{name}"),
    ("PUT", "/api/v1/resources/{kind}/{name}"),
    ("PATCH", "/api/v1/resources/{kind}/{name}"),
    ("DELETE", "/api/v1/resources/{kind}/{name}"),
    ("GET", "/api/v1/actions"),
    ("GET", "/api/v1/actions/{action_id}"),
    ("POST", "/api/v1/actions/{action_id}/undo"),
    ("POST", "/api/v1/runs/{run_id}/plans"),
    ("GET", "/api/v1/plans/{plan_id}"),
)
