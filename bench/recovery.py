"""The figure "recovery after a worker kill, p50 / max" (issue 38 §3): how long after a worker
is killed (SIGKILL) in the middle of a write that write is applied, by the workers that are
still running, exactly once.

Each kill: a worker of the Procfile's line (its own queue, the crash hook
AIRLOCK_TEST_CRASH_AT=inside_barrier_before_commit: it kills itself inside the write's
transaction, after the claim, with the resource's lock held) takes one auto-approved update
of its own resource, and dies. The Procfile's two workers and its cron process keep running
with default settings (a 30 s lock, a 32 s lease); the figure is the time from the death to
the action `applied`. The kills overlap, sent 2 s apart, so that each meets the reconciler's
5 s cycle and the presence beats at a phase of its own (and the figure costs about 25 s).

Routing one write to one doomed worker: the update is proposed under an engaged kill switch
on its resource (recorded `paused`, no job), then the switch row is released and the action
queued in one transaction (what a release does, without its enqueue), and its one job is
put on the doomed worker's queue with the outbox's marker, as the outbox would on `default`.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction
from rq import Queue, Worker

from approvals.models import Action, ActionStatus
from approvals.outbox import EXECUTE_ACTION_JOB, engine_redis, marker_key
from audit.models import AuditEvent
from audit.services import Actor
from bench import fixtures
from bench.report import figure
from bench.stack import log
from console.models import KillSwitch
from console.services import kill_switch_set
from ownership.models import ResourceVersion

if TYPE_CHECKING:  # bench.figures registers this figure (an import cycle at run time)
    from bench.figures import Bench

KEYS = ["worker_kill_recovery_p50_s", "worker_kill_recovery_max_s"]
CRASH_AT = "inside_barrier_before_commit"
DEATH_TIMEOUT_SECONDS = 60.0  # from the write sent to its worker's death (boot included)
RECOVERY_TIMEOUT_SECONDS = 90.0
STAGGER_SECONDS = 2.0


def worker_kill_recovery(b: Bench) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    kills = [_Kill(f"kill-{tag}-{i}", f"bench-kill-{tag}-{i}") for i in range(b.size.worker_kills)]
    names = [kill.name for kill in kills]
    fixtures.create_resources(b.core, "bench-core", names, {"n": 0})
    person = Actor.person(b.world.admin)
    for kill in kills:
        scope = f"bench-core/{kill.name}"
        kill_switch_set(scope=scope, engaged=True, reason="bench", actor=person)
        kill.action = fixtures.propose(b.core, "bench-core", kill.name, {"n": 1}, if_match='"1"')
        if kill.action.status != ActionStatus.PAUSED:
            raise RuntimeError(f"{scope}: the update proposed under its switch was not paused")
        b.stack.start_doomed_worker(kill.queue, CRASH_AT)  # all boot at once
        kill.worker = b.stack.processes["doomed"][-1]
    _wait_listening(kills)
    _watch(kills)
    samples = [kill.recovered for kill in kills if kill.recovered is not None]
    errors = [kill.problem for kill in kills if kill.problem]
    log(f"worker kills: recovered after {samples} s; problems {errors}")
    p50 = round(statistics.median(samples), 1) if samples else None
    worst = round(max(samples), 1) if samples else None
    detail = {"samples_s": samples, "crash_at": CRASH_AT, "problems": errors}
    return {
        "worker_kill_recovery_p50_s": figure(
            "worker_kill_recovery_p50_s", p50, errors=len(errors), kills=len(kills), **detail
        ),
        "worker_kill_recovery_max_s": figure(
            "worker_kill_recovery_max_s", worst, errors=len(errors), kills=len(kills)
        ),
    }


@dataclass
class _Kill:
    name: str
    queue: str
    action: Any = None
    worker: Any = None  # the doomed worker's process
    sent_at: float | None = None
    killed_at: float | None = None
    recovered: float | None = None  # seconds from the death to the write applied
    problem: str = ""


def _watch(kills: list[_Kill]) -> None:
    """Send each kill's write STAGGER_SECONDS after the last (the kills overlap, each at its
    own phase of the reconciler's cycle and the presence beats); note each death and each
    recovery until every kill is settled or out of time."""
    next_send = time.monotonic()
    while any(not (kill.recovered is not None or kill.problem) for kill in kills):
        now = time.monotonic()
        unsent = [kill for kill in kills if kill.sent_at is None]
        if unsent and now >= next_send:
            _send(unsent[0])
            next_send = now + STAGGER_SECONDS
        for kill in kills:
            if kill.sent_at is not None and not kill.problem and kill.recovered is None:
                _observe(kill, now)
        time.sleep(0.02)


def _wait_listening(kills: list[_Kill]) -> None:
    """Until every doomed worker has booted and listens on its queue (so that the staggered
    sends, not the boots, set when each dies)."""
    connection = engine_redis()
    deadline = time.monotonic() + DEATH_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        queues = [Queue(kill.queue, connection=connection) for kill in kills]
        if all(Worker.all(queue=queue) for queue in queues):
            return
        time.sleep(0.1)
    raise RuntimeError("the doomed workers did not start listening within a minute")


def _send(kill: _Kill) -> None:
    """Queue the write and put its one job on the doomed worker's queue (see the module
    docstring), with the outbox's marker: the reconciler sees a job, not a lost one."""
    with transaction.atomic():
        KillSwitch.objects.filter(scope=f"bench-core/{kill.name}").update(engaged=False)
        Action.objects.filter(pk=kill.action.pk, status=ActionStatus.PAUSED).update(
            status=ActionStatus.QUEUED, paused_reason=""
        )
    job_id = f"airlock-action-{kill.action.pk}-{uuid.uuid4().hex[:12]}"
    connection = engine_redis()
    pipe = connection.pipeline()
    Queue(kill.queue, connection=connection).enqueue(
        EXECUTE_ACTION_JOB, str(kill.action.pk), job_id=job_id, result_ttl=0, pipeline=pipe
    )
    pipe.set(marker_key("action", kill.action.pk), job_id, ex=3600)
    pipe.execute()
    kill.sent_at = time.monotonic()


def _observe(kill: _Kill, now: float) -> None:
    if kill.killed_at is None:
        if kill.worker.poll() is None:
            if now - (kill.sent_at or now) > DEATH_TIMEOUT_SECONDS:
                kill.problem = f"{kill.name}: the worker did not die in its write"
            return
        if kill.worker.returncode != -9:
            kill.problem = f"{kill.name}: the worker exited {kill.worker.returncode}, not SIGKILL"
            return
        kill.killed_at = now
    status = Action.objects.values_list("status", flat=True).get(pk=kill.action.pk)
    waited = round(now - kill.killed_at, 2)
    if status in (ActionStatus.EXECUTING, ActionStatus.QUEUED):
        if waited > RECOVERY_TIMEOUT_SECONDS:
            kill.problem = f"{kill.name}: still {status} {waited} s after the kill"
        return
    applied = ResourceVersion.objects.filter(action_id=kill.action.pk).count()
    events = AuditEvent.objects.filter(event_type="write.applied", action_id=kill.action.pk)
    if status != ActionStatus.APPLIED or applied != 1 or events.count() != 1:
        kill.problem = f"{kill.name}: {status} after {waited} s, {applied} versions written"
    else:
        kill.recovered = waited
