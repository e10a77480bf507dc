"""OpenTelemetry traces (console/tracing.py): one action is ONE connected trace, from the
agent's proposal through a person's approval (and the wait for it) to the write applied by
a real RQ worker; off by default, when nothing is imported and nothing is recorded.

Two ways: in this process with the SDK's InMemorySpanExporter (the API through Django's
test client, a real RQ worker's `work(burst=True)`), and as deployed: uvicorn and the
Procfile's worker in their own processes, switched on by OTEL_EXPORTER_OTLP_ENDPOINT alone
and exporting OTLP/HTTP to a small receiver in this test.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import redis

from approvals.models import Action
from approvals.worker import EngineWorker
from console import tracing
from tests.conftest import ROOT, subprocess_env
from tests.fixtures.api import start_api_server, stop_api_server
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

POLICY = "/api/v1/resources/notification-policy/prod-alerts"
ENGINE_SPANS = {
    "airlock.propose",
    "airlock.approval.wait",
    "airlock.decide",
    "airlock.enqueue",
    "airlock.job",
    "airlock.lock",
    "airlock.fence",
    "airlock.barrier",
}


@dataclass
class SpanRow:
    """One finished span, whichever way it was exported."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    service: str
    attributes: dict[str, Any]
    links: list[str] = field(default_factory=list)  # the linked spans' trace ids
    start_ns: int = 0
    end_ns: int = 0


def _from_sdk(spans: Any) -> list[SpanRow]:
    rows = []
    for span in spans:
        context, parent = span.context, span.parent
        rows.append(
            SpanRow(
                name=span.name,
                trace_id=f"{context.trace_id:032x}",
                span_id=f"{context.span_id:016x}",
                parent_id=f"{parent.span_id:016x}" if parent is not None else "",
                kind=span.kind.name,
                service=str(span.resource.attributes.get("service.name")),
                attributes=dict(span.attributes or {}),
                links=[f"{link.context.trace_id:032x}" for link in span.links],
                start_ns=span.start_time,
                end_ns=span.end_time,
            )
        )
    return rows


def _the_actions_trace(rows: list[SpanRow], action_id: str) -> list[SpanRow]:
    """The spans of the trace the action's proposal started, checked to be ONE tree: a
    single root, every other span's parent in the trace."""
    [propose] = [
        r
        for r in rows
        if r.name == "airlock.propose" and r.attributes["airlock.action"] == action_id
    ]
    trace = [r for r in rows if r.trace_id == propose.trace_id]
    ids = {r.span_id for r in trace}
    roots = [r for r in trace if not r.parent_id]
    assert len(roots) == 1, [(r.name, r.parent_id) for r in roots]
    orphans = [r.name for r in trace if r.parent_id and r.parent_id not in ids]
    assert not orphans, orphans
    return trace


def _parent(trace: list[SpanRow], row: SpanRow) -> SpanRow:
    [parent] = [r for r in trace if r.span_id == row.parent_id]
    return parent


def _one(trace: list[SpanRow], name: str) -> SpanRow:
    found = [r for r in trace if r.name == name]
    assert len(found) == 1, (name, [r.name for r in trace])
    return found[0]


def _check_the_chain(trace: list[SpanRow], action_id: str) -> None:
    """proposal <- decision <- enqueue <- job <- lock, fence, barrier; the wait spans the
    time between the proposal and the decision."""
    names = {r.name for r in trace}
    assert names >= ENGINE_SPANS, ENGINE_SPANS - names
    propose, decide = _one(trace, "airlock.propose"), _one(trace, "airlock.decide")
    wait, job = _one(trace, "airlock.approval.wait"), _one(trace, "airlock.job")
    assert _parent(trace, decide) is propose and decide.attributes["airlock.action"] == action_id
    assert decide.links and decide.links[0] != propose.trace_id  # the decision request's own
    assert _parent(trace, wait) is propose and propose.end_ns <= wait.end_ns <= decide.start_ns
    assert job.kind == "CONSUMER" and job.attributes["rq.function"] == "execute_action_job"
    enqueue = _parent(trace, job)
    assert enqueue.name == "airlock.enqueue" and enqueue.kind == "PRODUCER"
    assert _parent(trace, enqueue) is decide
    assert decide.end_ns <= job.start_ns
    barrier = _one(trace, "airlock.barrier")
    assert (
        barrier.attributes.get("airlock.batch_size") == 1
        or barrier.attributes.get("airlock.action") == action_id
    )
    below_job = {r.name for r in trace if _descends_from(trace, r, job)}
    assert {"airlock.lock", "airlock.fence", "airlock.barrier"} <= below_job
    fence = next(r for r in trace if r.name == "airlock.fence")
    assert isinstance(fence.attributes["airlock.fence"], int)


def _descends_from(trace: list[SpanRow], row: SpanRow, ancestor: SpanRow) -> bool:
    while row.parent_id:
        row = _parent(trace, row)
        if row is ancestor:
            return True
    return False


def _propose(client: Any, run: Any, key: str) -> dict[str, Any]:
    response = client.patch(
        POLICY,
        token=run.token,
        body={"channels": ["email", "pager"]},
        headers={"If-Match": '"41"', "Idempotency-Key": key},
    )
    assert response.status_code == 202, response.content
    body: dict[str, Any] = response.json()
    assert body["status"] == "pending_approval"
    return body


def _approve(client: Any, person: Any, action_id: str) -> None:
    listing = client.get("/api/v1/approvals?status=pending", token=person.token)
    [item] = [i for i in listing.json()["items"] if i.get("action") == action_id]
    decided = client.post(
        f"/api/v1/approvals/{item['id']}/decision",
        token=person.token,
        body={"decision": "approve", "comment": "traced"},
    )
    assert decided.status_code == 200, decided.content


def test_one_action_is_one_trace_in_memory_with_a_real_worker(
    api: Any, run: Any, operator: Any, prod_alerts: Any, engine_redis: Any
) -> None:
    with tracing.in_memory(django=True) as exporter:
        action = _propose(api, run, "key-trace-00001")
        _approve(api, operator, action["id"])
        worker = EngineWorker(["default"], connection=redis.Redis.from_url(engine_redis.url))
        worker.work(burst=True)
        assert Action.objects.get(pk=action["id"]).status == "applied"
    rows = _from_sdk(exporter.get_finished_spans())
    trace = _the_actions_trace(rows, action["id"])
    _check_the_chain(trace, action["id"])
    # The root is the agent's HTTP request (Django's instrumentation), the decision
    # request stays a trace of its own that the decision links to.
    [root] = [r for r in trace if not r.parent_id]
    assert root.kind == "SERVER" and "PATCH" in root.name
    decide = _one(trace, "airlock.decide")
    decision_request = [r for r in rows if r.trace_id == decide.links[0] and not r.parent_id]
    assert [r.kind for r in decision_request] == ["SERVER"]
    # Off again: nothing recorded, the job meta carries nothing.
    assert not tracing.enabled() and tracing.job_meta() == {}


def test_the_jobs_log_lines_carry_action_run_resource_and_trace(
    api: Any, run: Any, operator: Any, prod_alerts: Any, engine_redis: Any, caplog: Any
) -> None:
    """A real line the job logs (the fence floor's first check in a process) carries the
    job, action, run, resource and, with tracing on, the job's trace id."""
    from console.logging_filters import LogContext
    from engine.core.fence import forget_fence_floor_check

    caplog.set_level("INFO", logger="airlock")
    caplog.handler.addFilter(LogContext())
    with tracing.in_memory() as exporter:
        action = _propose(api, run, "key-trace-00002")
        _approve(api, operator, action["id"])
        forget_fence_floor_check()  # the job's fence draw logs its check again
        EngineWorker(["default"], connection=redis.Redis.from_url(engine_redis.url)).work(
            burst=True
        )
    job = next(s for s in exporter.get_finished_spans() if s.name == "airlock.job")
    assert Action.objects.get(pk=action["id"]).status == "applied"
    lines = [r for r in caplog.records if getattr(r, "job", "") and r.name.startswith("airlock")]
    assert lines, [r.getMessage() for r in caplog.records]
    line = lines[0]
    assert line.action == action["id"]
    assert line.run == str(run.run.pk)
    assert line.resource == "notification-policy/prod-alerts"
    assert line.trace_id == f"{job.context.trace_id:032x}"


def test_off_by_default_imports_nothing_and_adds_no_job_meta() -> None:
    """A fresh process without the variable: the engine loaded, a web application made,
    the worker class imported — and no OpenTelemetry module in sys.modules."""
    code = (
        "import sys, django; django.setup();"
        "import console.asgi, approvals.worker, approvals.jobs;"
        "from console import tracing;"
        "assert not tracing.enabled() and tracing.job_meta() == {};"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    env = subprocess_env()
    for name in tracing.ENDPOINT_VARIABLES:
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


# -- as deployed: OTLP/HTTP to a receiver -----------------------------------------------


class _Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)
        self.rows: list[SpanRow] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        rows = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    rows.append(_row(span, resource.get("service.name", "")))
        with self.server.lock:
            self.server.rows.extend(rows)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _row(span: Any, service: str) -> SpanRow:
    attributes: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        attributes[attribute.key] = getattr(value, value.WhichOneof("value") or "string_value")
    return SpanRow(
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex(),
        kind=_KINDS.get(span.kind, str(span.kind)),
        service=service,
        attributes=attributes,
        links=[link.trace_id.hex() for link in span.links],
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
    )


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class _HttpApi:
    """The same calls as the test client's, against a real server."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=10)

    def _headers(self, token: str, headers: dict[str, str] | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}", **(headers or {})}

    def patch(self, path: str, *, token: str, body: Any, headers: dict[str, str]) -> Any:
        return self.client.patch(path, json=body, headers=self._headers(token, headers))

    def get(self, path: str, *, token: str) -> Any:
        return self.client.get(path, headers=self._headers(token, None))

    def post(self, path: str, *, token: str, body: Any) -> Any:
        return self.client.post(path, json=body, headers=self._headers(token, None))


def test_one_action_is_one_trace_across_the_web_and_worker_processes(
    run: Any, operator: Any, prod_alerts: Any, engine_redis: Any, rq_worker: Any, receiver: Any
) -> None:
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    worker = rq_worker(**otel)
    server = start_api_server(**otel, REDIS_URL=engine_redis.url)
    try:
        http = _HttpApi(server.url)
        action = _propose(http, run, "key-trace-00003")
        _approve(http, operator, action["id"])
        wait_for(lambda: Action.objects.get(pk=action["id"]).status == "applied", timeout=20)

        def complete() -> bool:
            with receiver.lock:
                rows = list(receiver.rows)
            try:
                _check_the_chain(_the_actions_trace(rows, action["id"]), action["id"])
            except (AssertionError, ValueError, KeyError, StopIteration):
                return False
            return True

        wait_for(complete, timeout=20)
    finally:
        stop_api_server(server)
    with receiver.lock:
        rows = list(receiver.rows)
    trace = _the_actions_trace(rows, action["id"])
    assert {r.service for r in trace} == {"airlock-web", "airlock-worker"}, worker.output()
    job = _one(trace, "airlock.job")
    assert job.service == "airlock-worker" and _one(trace, "airlock.propose").service == (
        "airlock-web"
    )
    # The instrumentations: Django's request span is the root, psycopg's statements and
    # redis' commands appear in both processes.
    [root] = [r for r in trace if not r.parent_id]
    assert root.kind == "SERVER" and root.service == "airlock-web"
    statements = {r.service for r in trace if r.attributes.get("db.system") == "postgresql"}
    commands = {r.service for r in trace if r.attributes.get("db.system") == "redis"}
    assert statements == {"airlock-web", "airlock-worker"}, {r.name for r in trace}
    assert commands == {"airlock-web", "airlock-worker"}, {r.name for r in trace}
