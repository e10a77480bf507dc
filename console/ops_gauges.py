"""The operational gauges of /metrics that deploy/grafana/airlock.json and
deploy/prometheus/alerts.yml are built on: what waits for people and for how long, what is
stuck, the queue, the workers and cron, the audit chain and the kill switches.

Every value is read from work in flight through an index (pending approvals, unknown
operations, engaged switches), or from Redis (the queue's length, RQ's heartbeats, the
reconciler's counters). Labels are enumerations and slugs, never free text.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import cast

import redis
from django.db.models import Count, Min, Q
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Approval,
    ApprovalStatus,
    Operation,
    OperationStatus,
)
from approvals.outbox import engine_queue, engine_redis
from audit.linker import audit_unlinked
from audit.services import audit_chain_last_known
from console.health import live_cron_schedulers, live_workers
from console.models import KillSwitch

# "Close to expiry": pending approvals whose deadline is nearer than this (the alert's window).
EXPIRING_SOON = timedelta(minutes=15)
# What the reconciler did, counted in Redis by its job (approvals/jobs.py): a Prometheus
# counter per kind of repair. A Redis restart resets them, which Prometheus reads as a reset.
RECONCILE_COUNTER_KEY = "airlock:metrics:reconcile"


def record_reconcile_counts(counts: dict[str, int], connection: redis.Redis | None = None) -> None:
    """Add one reconciler pass's repairs to the shared counters (nothing when it did nothing)."""
    done = {name: n for name, n in counts.items() if n}
    if not done:
        return
    pipe = (connection or engine_redis()).pipeline(transaction=False)
    for name, n in done.items():
        pipe.hincrby(RECONCILE_COUNTER_KEY, name, n)
    pipe.execute()


def _gauge(
    name: str, help_text: str, samples: Iterable[tuple[str, float]], kind: str = "gauge"
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {value:g}" for labels, value in samples]
    return lines


def _age(since: datetime | None) -> float:
    return max(0.0, (timezone.now() - since).total_seconds()) if since else 0.0


def _approval_metrics() -> list[str]:
    """One aggregate over the pending approvals (the (status, created_at) index)."""
    soon = timezone.now() + EXPIRING_SOON
    pending = Approval.objects.filter(status=ApprovalStatus.PENDING).aggregate(
        run=Count("id", filter=Q(subject="run")),
        action=Count("id", filter=Q(subject="action")),
        plan=Count("id", filter=Q(subject="plan")),
        oldest=Min("created_at"),
        soon=Count("id", filter=Q(expires_at__lte=soon)),
    )
    return [
        *_gauge(
            "airlock_approvals_waiting",
            "Approvals waiting for a decision, by subject (run, action, plan).",
            [(f'{{subject="{s}"}}', float(pending[s])) for s in ("run", "action", "plan")],
        ),
        *_gauge(
            "airlock_approval_oldest_waiting_seconds",
            "Age of the oldest approval still waiting (0 when none waits).",
            [("", _age(pending["oldest"]))],
        ),
        *_gauge(
            "airlock_approvals_expiring_soon",
            "Approvals waiting whose deadline is less than 15 minutes away.",
            [("", float(pending["soon"]))],
        ),
    ]


def _stuck_metrics() -> list[str]:
    unknown = Operation.objects.filter(status=OperationStatus.UNKNOWN).aggregate(
        n=Count("id"), oldest=Min("started_at")
    )
    paused = dict(
        Action.objects.filter(status=ActionStatus.PAUSED)
        .values_list("kind_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    return [
        *_gauge(
            "airlock_operations_unknown",
            "Operations whose outcome is unknown (a target timed out after the request was sent).",
            [("", float(unknown["n"]))],
        ),
        *_gauge(
            "airlock_operation_unknown_oldest_seconds",
            "Age of the oldest operation whose outcome is unknown (0 when none).",
            [("", _age(unknown["oldest"]))],
        ),
        *_gauge(
            "airlock_paused_actions_by_kind",
            "Actions paused by a kill switch, by resource kind.",
            [(f'{{kind="{kind}"}}', float(n)) for kind, n in sorted(paused.items())],
        ),
    ]


def _switch_metrics() -> list[str]:
    engaged = KillSwitch.objects.filter(engaged=True).values_list("scope", "changed_at")
    return _gauge(
        "airlock_kill_switch_engaged_seconds",
        "How long each engaged kill switch has been engaged, by scope.",
        [(f'{{scope="{scope}"}}', _age(at)) for scope, at in engaged],
    )


def _process_metrics() -> list[str]:
    connection = engine_redis()
    try:
        depth = float(engine_queue(connection).count)
        workers = float(len(live_workers(connection)))
        cron = float(len(live_cron_schedulers(connection)))
        raw = cast("dict[bytes, bytes]", connection.hgetall(RECONCILE_COUNTER_KEY))
        repairs = {k.decode(): int(v) for k, v in raw.items()}
    except redis.RedisError:
        return []
    return [
        *_gauge("airlock_queue_depth", "Jobs waiting in the engine's RQ queue.", [("", depth)]),
        *_gauge(
            "airlock_workers_listening",
            "RQ workers listening on the engine's queue.",
            [("", workers)],
        ),
        *_gauge(
            "airlock_cron_alive", "Cron schedulers with a heartbeat in the last 60 s.", [("", cron)]
        ),
        *_gauge(
            "airlock_reconciler_repairs_total",
            "What the outbox reconciler repaired, by kind (requeued: a job Redis lost; "
            "abandoned: work of a dead worker; resumed: paused work released; ...).",
            [(f'{{kind="{k}"}}', float(n)) for k, n in sorted(repairs.items())],
            kind="counter",
        ),
    ]


def _audit_metrics() -> list[str]:
    status = audit_chain_last_known()  # never a walk: a scrape stays cheap
    state = -1.0 if status is None else 1.0 if status.ok else 0.0
    walked = status.full_walk_at if status is not None else None
    return [
        *_gauge(
            "airlock_audit_chain_ok",
            "1 when the audit chain verified as far as it was last checked, 0 when it is "
            "broken, -1 when no check is recorded (Redis lost it; the hourly walk records one).",
            [("", state)],
        ),
        *_gauge(
            "airlock_audit_chain_verified_events",
            "Events of the audit chain verified at the last check.",
            [("", float(status.events) if status is not None else 0.0)],
        ),
        *_gauge(
            "airlock_audit_last_full_walk_timestamp_seconds",
            "When the whole audit chain was last walked (Unix time; 0 when not recorded).",
            [("", walked.timestamp() if walked else 0.0)],
        ),
        *_gauge(
            "airlock_audit_unlinked_seconds",
            "How long the oldest committed audit event has waited to be linked into the chain "
            "(0 when every one is linked; the `audit` process links them within ~50 ms).",
            [("", audit_unlinked().behind_seconds())],
        ),
    ]


def operational_metrics() -> list[str]:
    return [
        *_approval_metrics(),
        *_stuck_metrics(),
        *_switch_metrics(),
        *_process_metrics(),
        *_audit_metrics(),
    ]
