"""The client and the served OpenAPI document agree: every request the client can send
(method, path, headers) is an operation and parameters of the document, and every problem
code the document lists has a typed exception (and API.md's codes all do). Plus the retry
rules, on a scripted transport: what is retried, with which key, for how long."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from airlock_client import (
    ERRORS_BY_CODE,
    Airlock,
    AsyncAirlock,
    AsyncRunSession,
    ProblemError,
    RateLimited,
    StaleVersion,
    TransportFailed,
    ValidationError,
    plan_step,
)
from airlock_client import _protocol as protocol
from airlock_client.client import RunSession
from airlock_client.models import Resource, Run

pytestmark = pytest.mark.django_db

API_MD_CODES = {
    "unauthenticated",
    "forbidden",
    "not_found",
    "validation_error",
    "not_in_write_set",
    "run_not_active",
    "write_set_conflict",
    "leased",
    "precondition_required",
    "stale_version",
    "idempotency_key_missing",
    "idempotency_key_invalid",
    "idempotency_key_reused",
    "idempotency_key_in_flight",
    "kill_switch_engaged",
    "undo_window_expired",
    "rate_limited",
}
# Sent on every request; not operation parameters.
GENERAL_HEADERS = {
    "authorization",
    "accept",
    "user-agent",
    "content-type",
    "content-length",
    "host",
    "accept-encoding",
    "connection",
}

RUN_ID = "00000000-0000-4000-8000-000000000001"
ACTION_ID = "00000000-0000-4000-8000-000000000002"
RUN = {
    "id": RUN_ID,
    "status": "active",
    "agent": "a",
    "task": "t",
    "write_set": [],
    "ttl_seconds": 3600,
    "expires_at": "2030-01-01T00:00:00Z",
    "status_reason": "",
    "token": "rt_x",
}
ACTION = {"id": ACTION_ID, "status": "applied", "etag": '"a3"', "run": RUN_ID}
RESOURCE = {"kind": "notification-policy", "name": "prod-alerts", "version": 41, "etag": '"41"'}
PLAN_ID = "00000000-0000-4000-8000-000000000003"
PLAN = {"id": PLAN_ID, "status": "pending_approval", "run": RUN_ID, "steps": []}


def canned(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    if path.endswith("/whoami"):
        return httpx.Response(200, json={"principal": "agent", "name": "a"})
    if path.endswith("/plans") or path.startswith("/api/v1/plans/"):
        return httpx.Response(202 if request.method == "POST" else 200, json=PLAN)
    if path.startswith("/api/v1/runs"):
        if path == "/api/v1/runs" and request.method == "GET":
            return httpx.Response(200, json={"items": [RUN], "next": None})
        return httpx.Response(201 if request.method == "POST" else 200, json=RUN)
    if path.startswith("/api/v1/resources/"):
        if request.method == "GET":
            return httpx.Response(200, json=RESOURCE, headers={"ETag": '"41"'})
        return httpx.Response(202, json=ACTION)
    if path == "/api/v1/actions":
        return httpx.Response(200, json={"items": [ACTION], "next": None})
    if path.endswith("/undo"):
        return httpx.Response(202, json={**ACTION, "status": "undone"})
    return httpx.Response(200, json=ACTION, headers={"ETag": '"a3"'})


def exercise_every_call(record: list[httpx.Request]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        record.append(request)
        return canned(request)

    http = httpx.Client(transport=httpx.MockTransport(handler))
    airlock = Airlock("http://airlock.test", "ak_x", http=http)
    airlock.whoami()
    session = airlock.start_run("t", [("notification-policy/prod-alerts", ["update"])])
    airlock.join_run("rt_x")
    airlock.get_run(RUN_ID)
    base = session.read("notification-policy/prod-alerts")
    session.put(base, {"a": 1}, reason="why")
    session.patch(base, {"a": 2}, reason="why")
    session.delete(base, reason="why")
    session.create("notification-policy/new-one", {"a": 3}, reason="why")
    session.wait(ACTION_ID, timeout=5, until=lambda action: False)
    airlock.get_action(ACTION_ID)
    session.undo(ACTION_ID)
    session.actions()
    session.heartbeat()
    session.refresh()
    plan = session.propose_plan(
        [plan_step(base, "PATCH", patch={"a": 4}), plan_step("dns-record/x", "DELETE", etag='"2"')],
        reason="why",
    )
    session.wait_for_plan(plan, timeout=2, until=lambda plan: False)
    airlock.get_plan(PLAN_ID)
    session.finish()
    # Waiting on a pending run long-polls GET /runs/{id} with Prefer + If-None-Match.
    airlock._run(protocol.wait_for_run("t", RUN_ID, 2, until=lambda run: False))


def template_of(path: str, templates: list[str]) -> str | None:
    for template in templates:
        pattern = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path):
            return template
    return None


def test_every_request_the_client_sends_is_documented_in_the_served_openapi(client: Any) -> None:
    document = client.get("/api/v1/openapi.json").json()
    paths = document["paths"]
    record: list[httpx.Request] = []
    exercise_every_call(record)
    used: set[tuple[str, str]] = set()
    for request in record:
        template = template_of(request.url.path, sorted(paths, key=len, reverse=True))
        assert template is not None, f"{request.method} {request.url.path} is not in the document"
        operation = paths[template].get(request.method.lower())
        assert operation is not None, f"{request.method} {template} is not in the document"
        used.add((request.method, template))
        documented = {
            p["name"].lower() for p in operation.get("parameters", []) if p["in"] == "header"
        }
        sent = {name.lower() for name in request.headers} - GENERAL_HEADERS
        assert sent <= documented, f"{request.method} {template} sends undocumented {sent}"
        query = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
        assert set(request.url.params) <= query, f"{request.method} {template} query"
    assert used == set(protocol.ENDPOINTS)


def test_every_problem_code_of_the_document_and_of_api_md_has_a_typed_exception(
    client: Any,
) -> None:
    document = client.get("/api/v1/openapi.json").json()
    served = document["components"]["schemas"]["Problem"]["x-problem-codes"]
    assert set(served) == set(ERRORS_BY_CODE)
    assert set(ERRORS_BY_CODE) >= API_MD_CODES
    for code, entry in served.items():
        assert issubclass(ERRORS_BY_CODE[code], ProblemError)
        raised = protocol.problem_error(entry["status"], {"code": code, "retryable": True})
        assert type(raised) is ERRORS_BY_CODE[code]


# --- Retries, on a scripted transport --------------------------------------------------


def script(
    answers: list[Callable[[httpx.Request], httpx.Response]],
) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport answering the n-th request with the n-th answer (then the last)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1](request)

    return httpx.MockTransport(handler), seen


def scripted(
    answers: list[Callable[[httpx.Request], httpx.Response]],
) -> tuple[Airlock, list[httpx.Request]]:
    transport, seen = script(answers)
    http = httpx.Client(transport=transport)
    return Airlock("http://airlock.test", "rt_x", http=http, retry_budget=10), seen


def problem(status: int, code: str, retryable: bool, **extra: Any) -> Any:
    headers = {"Retry-After": str(extra.pop("retry_after"))} if "retry_after" in extra else {}
    body = {"code": code, "retryable": retryable, "status": status, "detail": code, **extra}
    return lambda request: httpx.Response(
        status, json=body, headers={"Content-Type": "application/problem+json", **headers}
    )


def dropped(request: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("Server disconnected without sending a response.")


def accepted(request: httpx.Request) -> httpx.Response:
    return httpx.Response(202, json=ACTION)


BASE = Resource("notification-policy", "prod-alerts", 41, '"41"', {}, "platform", {})


def session_of(airlock: Airlock) -> RunSession:
    return RunSession(airlock, Run.from_json(RUN), "rt_x")


def test_a_rate_limited_write_is_retried_after_retry_after_with_the_same_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("airlock_client.client.time.sleep", slept.append)
    airlock, seen = scripted([problem(429, "rate_limited", True, retry_after=2), accepted])
    session_of(airlock).patch(BASE, {"a": 1})
    assert len(seen) == 2
    assert seen[0].headers["Idempotency-Key"] == seen[1].headers["Idempotency-Key"]
    assert seen[0].content == seen[1].content
    assert len(slept) == 1 and 2.0 <= slept[0] <= 3.0


def test_a_write_whose_connection_broke_is_resent_with_the_same_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("airlock_client.client.time.sleep", lambda seconds: None)
    airlock, seen = scripted([dropped, accepted])
    session_of(airlock).put(BASE, {"a": 1})
    assert len(seen) == 2
    assert seen[0].headers["Idempotency-Key"] == seen[1].headers["Idempotency-Key"]
    assert seen[0].headers["If-Match"] == '"41"'


def test_a_run_creation_whose_connection_broke_is_resent_with_the_same_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("airlock_client.client.time.sleep", lambda seconds: None)
    created = lambda request: httpx.Response(201, json=RUN)  # noqa: E731
    airlock, seen = scripted([dropped, problem(503, "unavailable", True), created])
    write_set = [("notification-policy/prod-alerts", ["update"])]
    session = airlock.start_run("t", write_set, approval_timeout=0)
    assert session.id == RUN_ID and len(seen) == 3
    keys = {request.headers["Idempotency-Key"] for request in seen}
    assert len(keys) == 1 and len({request.content for request in seen}) == 1
    # Each call has its own key.
    airlock.start_run("t", write_set, approval_timeout=0)
    assert seen[-1].headers["Idempotency-Key"] not in keys


def keyless_post(token: str) -> protocol.Op[httpx.Response]:
    """A POST the server cannot replay (no Idempotency-Key): not replay-safe."""
    return (yield protocol.Call("POST", "/api/v1/runs", token, {}, b"{}", replay_safe=False))


@pytest.mark.parametrize(
    "answer",
    [problem(503, "unavailable", True), problem(500, "internal_error", True), dropped],
    ids=["503-unavailable", "500", "connection-broke"],
)
def test_a_request_without_a_key_is_not_resent_after_what_may_follow_commit(answer: Any) -> None:
    airlock, seen = scripted([answer, lambda request: httpx.Response(201, json=RUN)])
    with pytest.raises((ProblemError, TransportFailed)):
        airlock._run(keyless_post("ak_x"))
    assert len(seen) == 1


def test_a_request_without_a_key_is_resent_after_a_refusal_made_before_acting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("airlock_client.client.time.sleep", lambda seconds: None)
    created = lambda request: httpx.Response(201, json=RUN)  # noqa: E731
    airlock, seen = scripted([problem(429, "rate_limited", True, retry_after=1), created])
    assert airlock._run(keyless_post("ak_x")).status_code == 201
    assert len(seen) == 2


def stale_version(current_etag: str, **extra: Any) -> Any:
    """The server's 412 for a PUT of prod-alerts read at "41"."""
    return problem(
        412,
        "stale_version",
        False,
        resource="notification-policy/prod-alerts",
        expected_etag='"41"',
        current_etag=current_etag,
        **extra,
    )


def test_a_stale_version_is_raised_at_once_with_its_fields() -> None:
    airlock, seen = scripted(
        [
            stale_version(
                '"42"', conflict_class="replace_shared_document", resolver="group:operators"
            )
        ]
    )
    with pytest.raises(StaleVersion) as refused:
        session_of(airlock).put(BASE, {"a": 1})
    assert len(seen) == 1
    assert (refused.value.current_etag, refused.value.resolver) == ('"42"', "group:operators")
    assert refused.value.queued_action is None


def test_a_stale_version_names_the_queued_write_that_will_replace_the_version_read() -> None:
    queued = {"id": "0b5e0c1e-8f1d-4d52-9d0e-2a7c1f6c1a11", "url": "/api/v1/actions/0b5e0c1e"}
    airlock, seen = scripted([stale_version('"41"', queued_action=queued)])
    with pytest.raises(StaleVersion) as refused:
        session_of(airlock).put(BASE, {"a": 1})
    assert len(seen) == 1 and refused.value.queued_action == queued["id"]


def test_a_retry_after_beyond_the_budget_raises_rate_limited_without_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("airlock_client.client.time.sleep", slept.append)
    airlock, seen = scripted([problem(429, "rate_limited", True, retry_after=120)])
    with pytest.raises(RateLimited) as limited:
        session_of(airlock).patch(BASE, {"a": 1})
    assert limited.value.retry_after == 120 and len(seen) == 1 and slept == []


def test_a_plan_whose_connection_broke_is_resent_with_the_same_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("airlock_client.client.time.sleep", lambda seconds: None)
    airlock, seen = scripted([dropped, lambda request: httpx.Response(202, json=PLAN)])
    plan = session_of(airlock).propose_plan([plan_step(BASE, "DELETE")], reason="r")
    assert plan.id == PLAN_ID and plan.pending and not plan.is_final
    assert len(seen) == 2
    assert seen[0].headers["Idempotency-Key"] == seen[1].headers["Idempotency-Key"]
    assert seen[0].content == seen[1].content


def test_waiting_for_a_plan_long_polls_with_its_etag_until_it_is_final() -> None:
    answers = [
        lambda request: httpx.Response(200, json=PLAN, headers={"ETag": '"p1"'}),
        lambda request: httpx.Response(304, headers={"ETag": '"p1"'}),
        lambda request: httpx.Response(
            200, json={**PLAN, "status": "applied"}, headers={"ETag": '"p4"'}
        ),
    ]
    airlock, seen = scripted(answers)
    plan = airlock.wait_for_plan(PLAN_ID, timeout=30)
    assert plan.applied and plan.is_final and plan.etag == '"p4"'
    assert len(seen) == 3
    assert "Prefer" not in seen[0].headers
    assert [r.headers["If-None-Match"] for r in seen[1:]] == ['"p1"', '"p1"']
    assert all(r.headers["Prefer"].startswith("wait=") for r in seen[1:])


def test_a_plan_step_is_built_from_what_was_read_and_refuses_a_shape_the_server_would() -> None:
    assert plan_step(BASE, "PATCH", patch={"a": 1}) == {
        "resource": "notification-policy/prod-alerts",
        "method": "PATCH",
        "if_match": '"41"',
        "patch": {"a": 1},
    }
    created = plan_step("dns-record/new", "PUT", document={"ip": "1"}, create=True)
    assert created["if_none_match"] == "*" and "if_match" not in created
    undo_by_hand = {"method": "PUT", "document": {"a": 0}}
    assert plan_step(BASE, "DELETE", compensation=undo_by_hand)["compensation"] == undo_by_hand
    with pytest.raises(ValueError, match="needs the ETag"):
        plan_step("dns-record/x", "PATCH", patch={})
    with pytest.raises(ValueError, match="PUT needs document"):
        plan_step(BASE, "PUT")
    with pytest.raises(ValueError, match="DELETE takes no patch"):
        plan_step(BASE, "DELETE", patch={"a": 1})
    with pytest.raises(ValueError, match="a create is a PUT"):
        plan_step("dns-record/x", "PATCH", patch={}, create=True)
    with pytest.raises(ValueError, match="kind/name"):
        plan_step("no-slash", "DELETE", etag='"1"')


def test_a_refused_plan_names_its_step_from_the_problem_or_its_field_errors() -> None:
    named = protocol.problem_error(412, {"code": "stale_version", "step": 2})
    assert named.step == 2
    from_field = protocol.problem_error(
        422,
        {"code": "validation_error", "errors": [{"field": "steps[1].resource", "message": "x"}]},
    )
    assert isinstance(from_field, ValidationError) and from_field.step == 2
    from_ninja = protocol.problem_error(
        422, {"code": "validation_error", "errors": [{"field": "body.payload.steps.0.x"}]}
    )
    assert from_ninja.step == 1
    whole = protocol.problem_error(
        422, {"code": "validation_error", "errors": [{"field": "steps", "message": "at most"}]}
    )
    assert whole.step is None


# --- The async client: the same surface, the same retries --------------------------------


def test_the_async_client_has_every_method_of_the_sync_one_with_the_same_parameters() -> None:
    for sync_class, async_class in ((Airlock, AsyncAirlock), (RunSession, AsyncRunSession)):
        public = {name for name in dir(sync_class) if not name.startswith("_")}
        assert public == {name for name in dir(async_class) if not name.startswith("_")}
        for name in public - {"id", "start_heartbeat"}:
            blocking, awaiting = getattr(sync_class, name), getattr(async_class, name)
            assert inspect.iscoroutinefunction(awaiting), f"{async_class.__name__}.{name}"
            parameters = inspect.signature(blocking).parameters
            assert parameters == inspect.signature(awaiting).parameters, name


def test_the_async_client_resends_a_rate_limited_write_with_the_same_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr("airlock_client.aclient.asyncio.sleep", sleep)
    transport, seen = script([problem(429, "rate_limited", True, retry_after=2), dropped, accepted])

    async def patch() -> Any:
        async with AsyncAirlock(
            "http://airlock.test", "rt_x", http=httpx.AsyncClient(transport=transport)
        ) as airlock:
            return await AsyncRunSession(airlock, Run.from_json(RUN), "rt_x").patch(BASE, {"a": 1})

    assert asyncio.run(patch()).id == ACTION_ID
    assert len(seen) == 3 and len({r.headers["Idempotency-Key"] for r in seen}) == 1
    assert len(slept) == 2 and 2.0 <= slept[0] <= 3.0
