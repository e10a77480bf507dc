"""The outbox's delivery side: enqueue approved work and wake long-pollers, after commit.

PostgreSQL is the outbox (an approved action or an accepted undo is a row); this module
only delivers. A leaf: it imports no service and no job module — jobs are enqueued by
their dotted path — so every service may import it without a cycle.

Delivery bookkeeping: each enqueue leaves a marker `airlock:outbox:<what>:<id>` = the RQ
job id (TTL one hour). The reconciler re-enqueues work that PostgreSQL says is due when
the marker is gone or names a job RQ no longer has pending (FLUSHALL, Redis restart, a job
lost with a dead worker). RQ does not deduplicate; duplicates are harmless because the
services re-check state with conditional UPDATEs.
"""

from __future__ import annotations

import contextvars
import logging
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from rq import Queue
from rq.job import Job, JobStatus
from rq.utils import str_to_date

from approvals.notify import action_channel, notify_action_changed
from console.redis_clients import shared_redis
from console.tracing import job_meta, traced_enqueue

log = logging.getLogger("airlock.outbox")

QUEUE_NAME = "default"
MARKER_TTL_SECONDS = 3600
EXECUTE_ACTION_JOB = "approvals.jobs.execute_action_job"
EXECUTE_UNDO_JOB = "approvals.jobs.execute_undo_job"
ADVANCE_PLAN_JOB = "approvals.jobs.advance_plan_job"
PLAN_AFTER_ACTION_JOB = "approvals.jobs.plan_after_action_job"
# A job that is still due in RQ's eyes: the outbox does not need to resend it. The stored
# texts, as a job's hash holds them (jobs_pending reads them raw).
PENDING_JOB_STATUSES = frozenset(
    status.value
    for status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.STARTED, JobStatus.DEFERRED)
)


def engine_redis() -> redis.Redis:
    """The Redis the engine's queue and locks live in (the URL is read at call time, so
    tests can point a process at a private server; one pooled client per URL, so a job
    does not open a new connection for every lock, publish and enqueue)."""
    return shared_redis(settings.REDIS_URL)


def engine_queue(connection: redis.Redis | None = None) -> Queue:
    return Queue(QUEUE_NAME, connection=connection or engine_redis())


def marker_key(kind: str, object_id: Any) -> str:
    return f"airlock:outbox:{kind}:{object_id}"


# --- Deliveries held for after an answer ----------------------------------------------


class HeldDeliveries:
    """Redis deliveries (job enqueues, long-poll wake-ups) held back by deliveries_held,
    each with the context it was asked for in (its trace span, its log fields)."""

    def __init__(self) -> None:
        self._sends: list[tuple[contextvars.Context, Callable[[], object]]] = []

    def hold(self, send: Callable[[], object]) -> None:
        self._sends.append((contextvars.copy_context(), send))

    def deliver(self) -> None:
        """Send what is held, in order, once (a second call sends nothing). Never raises:
        each send logs its own Redis failure (the reconciler resends a job; a lost wake-up
        costs a poller its safety re-check)."""
        sends, self._sends = self._sends, []
        for context, send in sends:
            context.run(send)


_HELD: contextvars.ContextVar[HeldDeliveries | None] = contextvars.ContextVar(
    "airlock_outbox_held", default=None
)


@contextmanager
def deliveries_held() -> Iterator[HeldDeliveries]:
    """Inside the block, the job enqueues that committed transactions ask for
    (enqueue_action_execution) are held instead of sent: the caller sends them
    (HeldDeliveries.deliver) once its answer is out — a person's decision answers without
    waiting for RQ's pipeline, and the worker the job wakes does not compete with the
    answer for the CPU. Long-pollers are still woken at once (a woken agent should not
    wait for the answer to the person). PostgreSQL is the outbox: if the process dies
    first, the reconciler sends the job. A block that raises sends what it held at once."""
    held = HeldDeliveries()
    token = _HELD.set(held)
    try:
        yield held
    except BaseException:
        _HELD.reset(token)
        held.deliver()
        raise
    _HELD.reset(token)


def _deliver(send: Callable[[], object]) -> None:
    """Send now, or hold it for the enclosing deliveries_held block."""
    held = _HELD.get()
    if held is None:
        send()
    else:
        held.hold(send)


@traced_enqueue
def _enqueue(
    kind: str,
    object_id: Any,
    job_path: str,
    *,
    delay_seconds: float = 0.0,
    connection: redis.Redis | None = None,
    wake: str | None = None,
) -> str:
    conn = connection or engine_redis()
    queue = engine_queue(conn)
    job_id = f"airlock-{kind}-{object_id}-{uuid.uuid4().hex[:12]}"
    try:
        _send(queue, conn, kind, object_id, job_path, job_id, delay_seconds, wake)
    except redis.RedisError:
        # PostgreSQL is the outbox: the reconciler sends it once Redis is back.
        log.warning("could not enqueue %s %s; the reconciler will resend it", kind, object_id)
    return job_id


def _send(
    queue: Queue,
    conn: redis.Redis,
    kind: str,
    object_id: Any,
    job_path: str,
    job_id: str,
    delay_seconds: float,
    wake: str | None = None,
) -> None:
    kwargs: dict[str, Any] = {
        "job_id": job_id,
        # Nobody reads these jobs' return values (the outcome is in PostgreSQL; the
        # reconciler reads a job's status only while it is pending), so a finished job
        # is deleted at once instead of being kept with its result.
        "result_ttl": 0,
        "failure_ttl": 24 * 3600,
        "job_timeout": 120,
        **job_meta(),  # the trace context, when tracing is on (console/tracing.py)
    }
    # One round trip for the job, its queue entry, the marker (RQ alone makes three: the
    # queue set, the job, then our marker) and the long-pollers' wake-up on channel `wake`,
    # if any (a publish of its own would be one more). RQ opens the pipeline's MULTI
    # itself, so nothing may be queued on it before the enqueue.
    pipe = conn.pipeline()
    if delay_seconds > 0:
        queue.enqueue_in(
            timedelta(seconds=delay_seconds), job_path, str(object_id), pipeline=pipe, **kwargs
        )
    else:
        queue.enqueue(job_path, str(object_id), pipeline=pipe, **kwargs)
    pipe.set(marker_key(kind, object_id), job_id, ex=MARKER_TTL_SECONDS)
    if wake is not None:
        pipe.publish(wake, b"changed")
    pipe.execute()


def jobs_pending(
    kind: str,
    object_ids: Sequence[Any],
    *,
    overdue: Collection[Any] = (),
    connection: redis.Redis | None = None,
    gone_workers: Callable[[Collection[str]], Collection[str]] | None = None,
) -> set[Any]:
    """Those of `object_ids` whose job RQ still holds queued, scheduled or running: two
    round trips whatever their number (the markers in one MGET, then each job's status,
    start and timeout in one pipeline), not three an object — the reconciler asks this of
    every due action of a backlog, from a worker the backlog is waiting for.

    A job is read in ONE command (HMGET), so one that finishes (and, with result_ttl 0, is
    deleted) while it is read is seen whole or not at all. `overdue`: their work was due a
    while ago, so a job still merely *scheduled* is stuck (no worker runs RQ's scheduler)
    and counts as missing. `gone_workers` (the reconciler's worker_presence check): given
    the names of the workers running the started jobs, says which are gone — a job
    "started" by a gone worker counts as missing at once.
    """
    if not object_ids:
        return set()
    conn = connection or engine_redis()
    keys = [marker_key(kind, oid) for oid in object_ids]
    markers: list[Any] = list(conn.mget(keys))  # type: ignore[arg-type]  # sync client
    named = [(oid, _text(raw)) for oid, raw in zip(object_ids, markers, strict=True) if raw]
    if not named:
        return set()
    pipe = conn.pipeline(transaction=False)
    for _, job_id in named:
        pipe.hmget(Job.key_for(job_id), ["status", "started_at", "timeout", "worker_name"])
    now = datetime.now(UTC)
    jobs = [
        (oid, *(_text(value) for value in fields))
        for (oid, _), fields in zip(named, pipe.execute(), strict=True)
    ]
    running_on = {worker for _, status, _, _, worker in jobs if status == JobStatus.STARTED}
    gone = set(gone_workers(running_on - {""})) if gone_workers and running_on else set()
    return {
        oid
        for oid, status, started_at, timeout, worker in jobs
        if _still_due(status, started_at, timeout, overdue=oid in overdue, now=now)
        and not (status == JobStatus.STARTED and worker in gone)
    }


def _text(value: Any) -> str:
    return bytes(value).decode() if value else ""


def _still_due(status: str, started_at: str, timeout: str, *, overdue: bool, now: datetime) -> bool:
    """Is a job with these stored fields still going to run (or running)? A job missing
    from RQ has no status."""
    if status not in PENDING_JOB_STATUSES:
        return False
    if overdue and status == JobStatus.SCHEDULED:
        return False
    if status == JobStatus.STARTED and started_at:
        # A job "started" by a worker that died (SIGKILL, OOM) stays so until RQ's
        # maintenance runs; past its timeout it is certainly not running any more.
        started = str_to_date(started_at)
        if started.tzinfo is None:
            started = started.replace(tzinfo=UTC)
        limit = int(timeout) if timeout.isdigit() else 120
        if now - started > timedelta(seconds=limit + 5):
            return False
    return True


def enqueue_action_execution(
    action_id: uuid.UUID | str,
    *,
    delay_seconds: float = 0.0,
    connection: redis.Redis | None = None,
    wake: bool = False,
) -> None:
    """Enqueue the execution job. Call from transaction.on_commit only. `wake`: also wake
    the action's long-pollers (notify_action_changed), in the same Redis round trip — or,
    inside deliveries_held, at once, the job being held."""
    if wake and _HELD.get() is not None:
        notify_action_changed(action_id)
        wake = False
    channel = action_channel(action_id) if wake else None
    _deliver(
        lambda: _enqueue(
            "action",
            action_id,
            EXECUTE_ACTION_JOB,
            delay_seconds=delay_seconds,
            connection=connection,
            wake=channel,
        )
    )


def enqueue_undo_execution(
    operation_id: int | str, *, delay_seconds: float = 0.0, connection: redis.Redis | None = None
) -> None:
    """Enqueue the undo job of an accepted undo operation. Call from on_commit only."""
    _enqueue(
        "undo", operation_id, EXECUTE_UNDO_JOB, delay_seconds=delay_seconds, connection=connection
    )


def withdraw_action_jobs(
    action_ids: list[uuid.UUID], *, connection: redis.Redis | None = None
) -> None:
    """Another job's batch has claimed these actions: take their own jobs off the queue,
    so that a worker does not spend a job on each only to find it claimed. A best
    effort: a job already dequeued runs, finds its action no longer queued and stops;
    one that is taken off is deleted (RQ would keep it forever), its marker with it (the
    reconciler then resends whatever PostgreSQL still says is due)."""
    if not action_ids:
        return
    conn = connection or engine_redis()
    queue_key = engine_queue(conn).key
    markers = [marker_key("action", action_id) for action_id in action_ids]
    try:
        found: list[Any] = list(conn.mget(markers))  # type: ignore[arg-type]  # sync client
        job_ids = [bytes(raw).decode() for raw in found if raw is not None]
        pipe = conn.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.lrem(queue_key, 1, job_id)
        removed = [job_id for job_id, count in zip(job_ids, pipe.execute(), strict=True) if count]
        pipe = conn.pipeline(transaction=False)
        for job_id in removed:
            pipe.delete(Job.key_for(job_id))
        pipe.delete(*markers)
        pipe.execute()
    except redis.RedisError:
        log.warning("could not withdraw the jobs of %d batched actions", len(action_ids))


def notify_actions_now(action_ids: list[uuid.UUID]) -> None:
    """Wake the long-pollers of several actions at once (one pipelined round trip), for
    changes already committed. A lost wake-up only delays a poller until its timeout."""
    if not action_ids:
        return
    try:
        pipe = engine_redis().pipeline(transaction=False)
        for action_id in action_ids:
            pipe.publish(action_channel(action_id), b"changed")
        pipe.execute()
    except redis.RedisError:
        log.warning("could not notify %d actions", len(action_ids), exc_info=True)


def notify_action_on_commit(action_id: uuid.UUID) -> None:
    """Wake long-pollers of the action once the current transaction commits."""

    def _notify() -> None:
        try:
            notify_action_changed(action_id)
        except Exception:  # a lost wake-up only delays a poller until its timeout
            log.warning("could not notify action %s", action_id, exc_info=True)

    transaction.on_commit(_notify)


def enqueue_plan_advance(
    plan_id: uuid.UUID | str, *, connection: redis.Redis | None = None
) -> None:
    """Enqueue one step of a plan's state machine (approvals/services/plan_engine.py).
    Call from transaction.on_commit only; the reconciler resends what Redis lost."""
    _enqueue("plan", plan_id, ADVANCE_PLAN_JOB, connection=connection)


def enqueue_plan_after_action(action_id: uuid.UUID | str) -> None:
    """A write that may be a plan's step (or the resolution of one) was settled by a
    person: let its plan, if any, go on. Call from transaction.on_commit only."""
    _enqueue("plan-action", action_id, PLAN_AFTER_ACTION_JOB)
