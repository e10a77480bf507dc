"""OpenTelemetry traces: off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or the traces-only
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set.

Off (the default) costs nothing measurable: this module imports no OpenTelemetry package
until `setup_from_env` finds the variable, `traced` functions call straight through after
one test of a module global, and `span`/`job_span` hand back one shared do-nothing context
manager. On, the web processes (console/asgi.py, console/wsgi.py) and the worker
(approvals/worker.py) each set up the SDK with the OTLP/HTTP exporter, the Django, psycopg
and redis instrumentations, and the engine's own spans:

    airlock.propose, airlock.decide (+ airlock.approval.wait), airlock.enqueue, airlock.job,
    airlock.lock, airlock.fence, airlock.barrier, airlock.target_call, airlock.undo

One action is ONE trace, from the agent's proposal to the write being applied, including
the wait for a person: the proposal's span context is remembered in Redis under the
action's id (`airlock:trace:action:<id>`, a week), the decision's span is made a child of
it (linked to the decision's own request trace, where Django's span stays), and an
enqueue names its parent in the RQ job's meta as a W3C `traceparent`, which the job's
span continues in the worker. A re-delivery by the reconciler or a retry joins the same
trace. The standard OTEL_* variables (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER,
OTEL_BSP_SCHEDULE_DELAY, OTEL_EXPORTER_OTLP_HEADERS, ...) are honoured by the SDK.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from django.conf import settings

if TYPE_CHECKING:
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("airlock.tracing")

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# How long an action's proposal context is remembered for its decision and execution: an
# approval waits at most 48 h by default; a week covers a later retry or re-delivery.
REMEMBER_SECONDS = 7 * 24 * 3600
TRACER_NAME = "airlock"

# Set by `configure` only; None means tracing is off (the only thing the off path reads).
_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_instrumentors: list[Any] = []
_NOTHING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def enabled() -> bool:
    return _tracer is not None


def endpoint_configured() -> bool:
    return bool(settings.OTEL_TRACES_ENDPOINT)


def setup_from_env(service_name: str, *, django: bool) -> bool:
    """Turn tracing on for this process if an OTLP endpoint is configured; else nothing
    (no OpenTelemetry import). `django`: instrument Django too — call it after
    django.setup() and before the request handler loads its middleware."""
    if _tracer is not None or not endpoint_configured():
        return _tracer is not None
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = configure(
        OTLPSpanExporter(),
        service_name=settings.OTEL_SERVICE_NAME or service_name,
        django=django,
    )
    trace.set_tracer_provider(provider)  # for any other library that asks the global one
    log.info("OpenTelemetry traces on (service %s)", service_name)
    return True


def configure(
    exporter: SpanExporter,
    *,
    service_name: str,
    django: bool = False,
    instrument: bool = True,
    batch: bool = True,
) -> TracerProvider:
    """Tracing on, exporting to `exporter` (tests pass an InMemorySpanExporter with
    batch=False). The global provider is left alone: `shutdown` can undo all of this."""
    global _tracer, _provider
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    if instrument:
        _instrument(provider, django=django)
    _provider = provider
    _tracer = provider.get_tracer(TRACER_NAME)
    return provider


def _instrument(provider: TracerProvider, *, django: bool) -> None:
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    instrumentors: list[Any] = [RedisInstrumentor(), PsycopgInstrumentor()]
    if django:
        # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        instrumentors.append(DjangoInstrumentor())
    for instrumentor in instrumentors:
        if not instrumentor.is_instrumented_by_opentelemetry:
            # skip_dep_check: psycopg is installed as psycopg[binary]; the check wants the
            # bare distribution's name.
            instrumentor.instrument(tracer_provider=provider, skip_dep_check=True)
            _instrumentors.append(instrumentor)


def shutdown() -> None:
    """Flush what is still buffered and turn tracing off (a worker's end, a test's)."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    while _instrumentors:
        _instrumentors.pop().uninstrument()
    if provider is not None:
        provider.shutdown()


def force_flush() -> None:
    if _provider is not None:
        _provider.force_flush()


# -- our own spans ---------------------------------------------------------------------


def traced(name: str, *, result: str = "") -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: the call is a span `name` when tracing is on, with the ids it was given
    (action, run, resource, fence, ... see _attributes) as attributes; `result`: an
    attribute name for the return value (e.g. the fence drawn). Off: one global test."""

    def wrap(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            tracer = _tracer
            if tracer is None:
                return function(*args, **kwargs)
            with tracer.start_as_current_span(name, attributes=_attributes(args, kwargs)) as span:
                value = function(*args, **kwargs)
                _note_result(span, value, result)
                return value

        return call

    return wrap


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """`with span("airlock.something", action=...)`: a span when tracing is on."""
    tracer = _tracer
    if tracer is None:
        return _NOTHING
    return tracer.start_as_current_span(name, attributes=_attributes((), attributes))


def traced_propose(function: Callable[P, R]) -> Callable[P, R]:
    """The proposal's span (`airlock.propose`); its context is remembered under the
    action's id, so that the decision and the execution join this trace."""

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        tracer = _tracer
        if tracer is None:
            return function(*args, **kwargs)
        with tracer.start_as_current_span(
            "airlock.propose", attributes=_attributes(args, kwargs)
        ) as current:
            action = function(*args, **kwargs)
            _note_result(current, action, "")
            action_id = getattr(action, "pk", None)
            if action_id is not None:
                _remember(action_id, current)
            return action

    return call


def traced_decide(function: Callable[P, R]) -> Callable[P, R]:
    """A decision's span (`airlock.decide`): for an action's approval, a child of the
    action's proposal (linked to the decision request's own trace), after a span
    `airlock.approval.wait` from the approval's opening to now — the wait for a person."""

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        tracer = _tracer
        if tracer is None:
            return function(*args, **kwargs)
        parent, links, attributes = None, [], _attributes(args, kwargs)
        found = _approval_subject(kwargs.get("approval_id"))
        if found is not None:
            action_id, opened_ns = found
            attributes["airlock.action"] = str(action_id)
            parent = _remembered(action_id)
            if parent is not None:
                links = _link_to_current()
                wait = tracer.start_span(
                    "airlock.approval.wait", context=parent, start_time=opened_ns
                )
                wait.set_attribute("airlock.action", str(action_id))
                wait.end()
        with tracer.start_as_current_span(
            "airlock.decide", context=parent, links=links, attributes=attributes
        ):
            return function(*args, **kwargs)

    return call


def traced_enqueue(function: Callable[P, R]) -> Callable[P, R]:
    """An enqueue's span (`airlock.enqueue`, kind producer); `job_meta` inside it names it
    as the job's parent. For an action's job: a child of the action's proposal when the
    current span belongs to another trace (a decision, the reconciler), linked to it."""

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        tracer = _tracer
        if tracer is None:
            return function(*args, **kwargs)
        # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
        from opentelemetry import trace

        kind, object_id = [*args, None, None][:2]
        parent, links = None, []
        if kind in ("action", "plan-action") and object_id is not None:
            remembered = _remembered(object_id)
            current = trace.get_current_span().get_span_context()
            if remembered is not None:
                proposal = trace.get_current_span(remembered).get_span_context()
                if not current.is_valid or current.trace_id != proposal.trace_id:
                    parent, links = remembered, _link_to_current()
        attributes = {"airlock.job_kind": str(kind), "airlock.object": str(object_id)}
        with tracer.start_as_current_span(
            "airlock.enqueue",
            context=parent,
            links=links,
            kind=trace.SpanKind.PRODUCER,
            attributes=attributes,
        ):
            return function(*args, **kwargs)

    return call


_NO_META: Mapping[str, Any] = {}


def job_meta() -> Mapping[str, Any]:
    """What an enqueue adds to the job's arguments: its `meta` with the W3C trace context
    of the current span, when tracing is on (off: an empty mapping, nothing added)."""
    if _tracer is None:
        return _NO_META
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return {"meta": carrier} if carrier else _NO_META


def job_span(job: Any, function_name: str) -> contextlib.AbstractContextManager[Any]:
    """The span of one RQ job's run (`airlock.job`, kind consumer), continuing the trace
    its enqueue named in the job's meta; the time it waited in the queue as an attribute."""
    tracer = _tracer
    if tracer is None:
        return _NOTHING
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    meta = getattr(job, "meta", None) or {}
    parent = TraceContextTextMapPropagator().extract(
        {key: value for key, value in meta.items() if key in ("traceparent", "tracestate")}
    )
    attributes: dict[str, Any] = {"messaging.system": "rq", "rq.function": function_name}
    if job is not None:
        attributes["messaging.message.id"] = str(job.id)
        enqueued, started = getattr(job, "enqueued_at", None), getattr(job, "started_at", None)
        if enqueued is not None and started is not None:
            waited = (started - enqueued).total_seconds() * 1000
            attributes["airlock.queue_wait_ms"] = round(waited, 3)
    return tracer.start_as_current_span(
        "airlock.job", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
    )


def current_ids() -> tuple[str, str] | None:
    """The current trace and span ids (hex), for log lines; None when off or outside one."""
    if _tracer is None:
        return None
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


# -- helpers (only reached when tracing is on) -------------------------------------------


def _attributes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ids a call was given, as span attributes: never a payload, token or document."""
    found: dict[str, Any] = {}
    this = args[0] if args else None
    if this is not None and isinstance(getattr(this, "key", None), str):  # a FencedLock
        found["airlock.resource"] = this.key
    if isinstance(this, list | tuple):  # a batch of writes (apply_locked_batch)
        found["airlock.batch_size"] = len(this)
    locks = getattr(this, "locks", None)
    if isinstance(locks, list):  # a FencedLockGroup
        found["airlock.locks"] = len(locks)
    for name, value in kwargs.items():
        if value is None:
            continue
        if name in ("action_id", "approval_id", "plan_id", "run_id"):
            found[f"airlock.{name.removesuffix('_id')}"] = str(value)
        elif name in ("operation_id", "undo_operation_id"):
            found["airlock.operation"] = str(value)
        elif name == "fence" and isinstance(value, int):
            found["airlock.fence"] = value
        elif name == "action":
            found.update(_action_attributes(value))
        elif name == "run":
            found["airlock.run"] = str(getattr(value, "pk", value))
        elif name == "writes" and isinstance(value, list | tuple):
            found["airlock.batch_size"] = len(value)
        elif name == "proposal" and isinstance(getattr(value, "resource_identifier", None), str):
            found["airlock.resource"] = value.resource_identifier
    return found


def _action_attributes(action: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if getattr(action, "pk", None) is not None:
        found["airlock.action"] = str(action.pk)
    if getattr(action, "run_id", None) is not None:
        found["airlock.run"] = str(action.run_id)
    if getattr(action, "kind_id", None) is not None and getattr(action, "name", None):
        found["airlock.resource"] = f"{action.kind_id}/{action.name}"
    return found


def _note_result(current: Span, value: Any, name: str) -> None:
    if name and isinstance(value, int | str):
        current.set_attribute(name, value)
    elif hasattr(value, "resource_identifier"):
        current.set_attributes(_action_attributes(value))
    elif isinstance(value, str):
        current.set_attribute("airlock.outcome", value)


def _link_to_current() -> list[Any]:
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return [trace.Link(context)] if context.is_valid else []


def _remember_key(action_id: Any) -> str:
    return f"airlock:trace:action:{action_id}"


def _remember(action_id: Any, current: Span) -> None:
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    # reason: loaded only when tracing is on (this module is imported by every layer)
    from console.redis_clients import shared_redis

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(current))
    if "traceparent" not in carrier:
        return
    try:
        shared_redis(settings.REDIS_URL).set(
            _remember_key(action_id), carrier["traceparent"], ex=REMEMBER_SECONDS
        )
    except Exception:  # a lost context only splits the trace in two
        log.warning("could not remember the trace of action %s", action_id, exc_info=True)


def _remembered(action_id: Any) -> Context | None:
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    # reason: loaded only when tracing is on (this module is imported by every layer)
    from console.redis_clients import shared_redis

    try:
        raw = shared_redis(settings.REDIS_URL).get(_remember_key(action_id))
    except Exception:
        log.warning("could not read the trace of action %s", action_id, exc_info=True)
        return None
    if not raw:
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return TraceContextTextMapPropagator().extract({"traceparent": text})


def _approval_subject(approval_id: Any) -> tuple[Any, int] | None:
    """The action an approval decides and when the approval opened (ns), if it is an
    action's approval (one primary-key read, only when tracing is on)."""
    if approval_id is None:
        return None
    # reason: loaded only when tracing is on (this module is imported by every layer)
    from approvals.models import Approval

    try:
        row = Approval.objects.filter(pk=approval_id).values_list("action_id", "created_at").first()
    except Exception:  # a malformed id: the service itself answers it
        return None
    if row is None or row[0] is None:
        return None
    action_id, opened = row
    return action_id, int(opened.timestamp() * 1e9) if opened else time.time_ns()


@contextlib.contextmanager
def in_memory(**kwargs: Any) -> Iterator[Any]:
    """Tests: tracing on into an InMemorySpanExporter (yielded), off again after."""
    # reason: OpenTelemetry is optional and heavy: imported only when tracing is on
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    configure(
        exporter, service_name=kwargs.pop("service_name", "airlock-test"), batch=False, **kwargs
    )
    try:
        yield exporter
    finally:
        shutdown()
