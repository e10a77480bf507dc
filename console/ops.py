"""Operational endpoints at the site root: /healthz and /metrics (Prometheus text).

Request latency is measured in-process by the API URL wrapper (each web
process exposes its own histogram, as Prometheus expects from a scrape per
process); domain gauges (actions by status, paused actions, conflicts by
class, approval and execution latency) are read from PostgreSQL. A scrape
runs only index scans over work in flight; totals over all history are
cached per process for HISTORY_CACHE_SECONDS. No label carries free text.
In production set METRICS_TOKEN (`check --deploy` warns, airlock.W010).
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import defaultdict
from typing import Any

import redis
from django.conf import settings
from django.db import connection
from django.db.models import Count, F, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET

from approvals.models import Action, ActionStatus, Approval, Operation
from approvals.notify import action_waiters
from console.health import readiness
from console.ops_gauges import operational_metrics
from console.problems import problem_response
from notifications.selectors import notification_metrics
from ownership.models import Conflict, ConflictStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_lock = threading.Lock()
_latency_counts: dict[tuple[str, str, str], list[int]] = defaultdict(
    lambda: [0] * (len(LATENCY_BUCKETS) + 1)
)
_latency_sums: dict[tuple[str, str, str], float] = defaultdict(float)


def observe_request(*, method: str, route: str, status: int, seconds: float) -> None:
    key = (method, route, f"{status // 100}xx")
    with _lock:
        counts = _latency_counts[key]
        for index, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                counts[index] += 1
        counts[-1] += 1
        _latency_sums[key] += seconds


def _check_database() -> str:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:
        return f"down: {type(exc).__name__}"
    return "ok"


def _check_redis() -> str:
    try:
        client = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1
        )
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:
        return f"down: {type(exc).__name__}"
    return "ok"


@require_GET
def healthz(request: HttpRequest) -> HttpResponse:
    """200 {"database": "ok", "redis": "ok"}, or 503 problem+json naming what is down."""
    status = {"database": _check_database(), "redis": _check_redis()}
    down = [name for name, value in status.items() if value != "ok"]
    if down:
        return problem_response(
            code="unavailable",
            detail=f"Down: {', '.join(down)}.",
            extra=status,
            headers={"Retry-After": "5", "Cache-Control": "no-store"},
        )
    response = HttpResponse(
        f'{{"database": "{status["database"]}", "redis": "{status["redis"]}"}}',
        content_type="application/json",
    )
    response["Cache-Control"] = "no-store"
    return response


@require_GET
def readyz(request: HttpRequest) -> HttpResponse:
    """Readiness, for a load balancer or an orchestrator's probe: 200 when the database and
    Redis answer, every migration is applied, a worker listens on the queue and the cron
    process beats; else 503 problem+json naming each part that is not ready. /healthz stays
    the liveness answer (this process and its two services)."""
    state = readiness()
    body = {
        **state.parts,
        "workers_listening": state.workers,
        "cron_schedulers": state.cron_schedulers,
    }
    headers = {"Cache-Control": "no-store"}
    if not state.ready:
        not_ready = [name for name, value in state.parts.items() if value != "ok"]
        return problem_response(
            code="unavailable",
            detail=f"Not ready: {', '.join(not_ready)}.",
            extra=body,
            headers={**headers, "Retry-After": "5"},
        )
    response = HttpResponse(json.dumps(body), content_type="application/json")
    response["Cache-Control"] = "no-store"
    return response


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# Work in flight: few rows, counted on every scrape through the (status, …) indexes.
_LIVE_ACTION_STATUSES = ("pending_approval", "queued", "executing", "paused")


def _live_metrics() -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """Actions in flight by status and open conflicts by class: index scans over live rows."""
    actions = dict(
        Action.objects.filter(status__in=_LIVE_ACTION_STATUSES)
        .values_list("status")
        .annotate(n=Count("id"))
        .order_by()
    )
    conflicts = {
        (str(klass), ConflictStatus.OPEN.value): int(n)
        for klass, n in Conflict.objects.filter(status=ConflictStatus.OPEN)
        .values_list("conflict_class_id")
        .annotate(n=Count("id"))
        .order_by()
    }
    return actions, conflicts


def _history_metrics() -> dict[str, Any]:
    """Totals over all history (finished actions, resolved conflicts, latency sums)."""
    return {
        "actions": dict(
            Action.objects.exclude(status__in=_LIVE_ACTION_STATUSES)
            .values_list("status")
            .annotate(n=Count("id"))
            .order_by()
        ),
        "conflicts": {
            (str(klass), str(status)): int(n)
            for klass, status, n in Conflict.objects.exclude(status=ConflictStatus.OPEN)
            .values_list("conflict_class_id", "status")
            .annotate(n=Count("id"))
            .order_by()
        },
        "approvals": Approval.objects.filter(decided_at__isnull=False).aggregate(
            n=Count("id"), total=Sum(F("decided_at") - F("created_at"))
        ),
        "operations": Operation.objects.filter(finished_at__isnull=False).aggregate(
            n=Count("id"), total=Sum(F("finished_at") - F("started_at"))
        ),
    }


# History totals scan whole tables: computed at most once per this many seconds
# per process, however often (and however many at once) Prometheus scrapes.
HISTORY_CACHE_SECONDS = 30.0
_history_lock = threading.Lock()
_history_cache: tuple[float, dict[str, Any]] | None = None


def _cached_history() -> dict[str, Any]:
    global _history_cache
    with _history_lock:
        now = time.monotonic()
        if _history_cache is None or now - _history_cache[0] >= HISTORY_CACHE_SECONDS:
            _history_cache = (now, _history_metrics())
        return _history_cache[1]


def forget_history_cache() -> None:
    """Drop the cached history totals (tests; the next scrape recomputes them)."""
    global _history_cache
    with _history_lock:
        _history_cache = None


def _domain_metrics() -> list[str]:
    """Domain gauges. Labels are enumerations and slugs only — never free text such
    as a kill switch's reason, which may name people or incidents."""
    live_actions, open_conflicts = _live_metrics()
    history = _cached_history()
    actions = {**history["actions"], **live_actions}
    lines = [
        "# HELP airlock_actions Actions by status (finished statuses refresh every "
        f"{HISTORY_CACHE_SECONDS:.0f} s).",
        "# TYPE airlock_actions gauge",
    ]
    for status in ActionStatus.values:
        lines.append(f'airlock_actions{{status="{status}"}} {actions.get(status, 0)}')
    lines += [
        "# HELP airlock_paused_actions Actions paused (kill switch) and waiting for a release.",
        "# TYPE airlock_paused_actions gauge",
        f"airlock_paused_actions {live_actions.get(ActionStatus.PAUSED, 0)}",
        "# HELP airlock_conflicts Conflicts by class and status (resolved ones refresh every "
        f"{HISTORY_CACHE_SECONDS:.0f} s).",
        "# TYPE airlock_conflicts gauge",
    ]
    conflicts = {**history["conflicts"], **open_conflicts}
    for (klass, status), n in sorted(conflicts.items()):
        lines.append(f'airlock_conflicts{{class="{_escape(klass)}",status="{status}"}} {n}')
    decided = history["approvals"]
    executed = history["operations"]
    lines += [
        "# HELP airlock_approval_latency_seconds Time from request to decision.",
        "# TYPE airlock_approval_latency_seconds summary",
        f"airlock_approval_latency_seconds_sum {_seconds(decided['total']):.3f}",
        f"airlock_approval_latency_seconds_count {decided['n']}",
        "# HELP airlock_execution_latency_seconds Time an operation took on a worker.",
        "# TYPE airlock_execution_latency_seconds summary",
        f"airlock_execution_latency_seconds_sum {_seconds(executed['total']):.3f}",
        f"airlock_execution_latency_seconds_count {executed['n']}",
    ]
    return lines


def _seconds(value: Any) -> float:
    if value is None:
        return 0.0
    return float(value.total_seconds())


def _request_metrics() -> list[str]:
    lines = [
        "# HELP airlock_http_request_duration_seconds API request latency (this process).",
        "# TYPE airlock_http_request_duration_seconds histogram",
    ]
    with _lock:
        snapshot = {key: list(counts) for key, counts in _latency_counts.items()}
        sums = dict(_latency_sums)
    for (method, route, status), counts in sorted(snapshot.items()):
        labels = f'method="{method}",route="{_escape(route)}",status="{status}"'
        for index, bound in enumerate(LATENCY_BUCKETS):
            lines.append(
                f'airlock_http_request_duration_seconds_bucket{{{labels},le="{bound}"}} '
                f"{counts[index]}"
            )
        lines.append(
            f'airlock_http_request_duration_seconds_bucket{{{labels},le="+Inf"}} {counts[-1]}'
        )
        lines.append(
            f"airlock_http_request_duration_seconds_sum{{{labels}}} "
            f"{sums[(method, route, status)]:.6f}"
        )
        lines.append(f"airlock_http_request_duration_seconds_count{{{labels}}} {counts[-1]}")
    return lines


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text; open unless METRICS_TOKEN is set (then Bearer METRICS_TOKEN)."""
    expected = settings.METRICS_TOKEN
    if expected:
        sent = request.headers.get("Authorization", "")
        scheme, _, token = sent.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), expected.encode()
        ):
            return problem_response(
                code="unauthenticated",
                detail="Send Authorization: Bearer <METRICS_TOKEN>.",
                headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
            )
    lines = [
        *_domain_metrics(),
        *operational_metrics(),
        *_request_metrics(),
        *notification_metrics(),
        "# HELP airlock_longpoll_waiters Long-poll requests held by this process.",
        "# TYPE airlock_longpoll_waiters gauge",
        f"airlock_longpoll_waiters {action_waiters.waiting}",
        "# HELP airlock_longpoll_held Long-poll requests past their first read, waiting "
        "for a change.",
        "# TYPE airlock_longpoll_held gauge",
        f"airlock_longpoll_held {action_waiters.held}",
    ]
    lines.append(f"airlock_metrics_generated_at_seconds {timezone.now().timestamp():.3f}")
    return HttpResponse(
        "\n".join(lines) + "\n", content_type="text/plain; version=0.0.4; charset=utf-8"
    )
