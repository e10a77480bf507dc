"""RQ jobs: thin, take ids, call one service each; they tolerate a missing row and
re-delivery (RQ does not deduplicate: idempotency lives in PostgreSQL).

Enqueueing lives in `approvals/outbox.py`, which names these jobs by dotted path, so no
service imports this module.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.conf import settings
from django.db import close_old_connections
from rq import get_current_job

from approvals.models import Operation
from approvals.services.attempts import crash_point
from approvals.services.execution import action_execute
from approvals.services.housekeeping import housekeeping_run
from approvals.services.plan_engine import plan_advance, plan_after_action
from approvals.services.reconcile import reconcile
from approvals.services.reread import reread_unsettled
from approvals.services.undo import undo_execute
from console.ops_gauges import record_reconcile_counts
from console.requestctx import log_fields_reset, log_fields_start
from console.tracing import job_span

P = ParamSpec("P")
R = TypeVar("R")


def _fresh_database(job: Callable[P, R]) -> Callable[P, R]:
    """Jobs run in long-lived worker processes (SimpleWorker): drop a connection that
    died or outlived CONN_MAX_AGE before the job, as a request would, so a PostgreSQL
    restart costs one retry instead of every later job."""

    names = job.__code__.co_varnames[: job.__code__.co_argcount]

    @functools.wraps(job)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        close_old_connections()
        # The job's log lines name it and what it works on (action_id -> "action": ...).
        current = get_current_job()
        on = {
            name.removesuffix("_id"): str(value) for name, value in zip(names, args, strict=False)
        }
        fields = log_fields_start(job=current.id if current else "", **on)
        try:
            # A span continuing the trace its enqueue named (off: a shared no-op).
            with job_span(current, job.__name__):
                return job(*args, **kwargs)
        finally:
            log_fields_reset(fields)
            close_old_connections()

    return run


@_fresh_database
def execute_action_job(action_id: str) -> str:
    # A job drains its action and the next due ones on other resources (group commit).
    outcome = action_execute(action_id=uuid.UUID(action_id), batch=settings.AIRLOCK_DRAIN_BATCH)
    # A plan's step (or a resolution of one) goes on to the next step in this worker.
    plan_after_action(action_id=action_id)
    return outcome


@_fresh_database
def execute_undo_job(operation_id: str) -> str:
    outcome = undo_execute(undo_operation_id=int(operation_id))
    compensated = (
        Operation.objects.filter(pk=int(operation_id), compensation=True)
        .values_list("action_id", flat=True)
        .first()
    )
    crash_point("after_undo_job")
    if compensated is not None:  # a plan's compensation: its plan compensates the next step
        plan_after_action(action_id=compensated)
    return outcome


@_fresh_database
def advance_plan_job(plan_id: str) -> str:
    return plan_advance(plan_id=plan_id)


@_fresh_database
def plan_after_action_job(action_id: str) -> str:
    return plan_after_action(action_id=action_id)


@_fresh_database
def reconcile_job() -> dict[str, int]:
    counts = reconcile()
    record_reconcile_counts(counts)  # /metrics' airlock_reconciler_repairs_total
    return counts


@_fresh_database
def housekeeping_job() -> dict[str, int]:
    return housekeeping_run()


@_fresh_database
def reread_job() -> dict[str, int]:
    """Writes and undos that ended with their outcome unknown, read again (reread.py)."""
    return reread_unsettled()
