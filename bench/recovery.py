"""The figure "recovery after a worker kill, p50 / max" (issue 38 §3): how long after a worker
is killed (SIGKILL) in the middle of a write that write is applied, by the workers that are
still running, exactly once.

Each kill: a worker of the Procfile's line (its own queue, the crash hook
AIRLOCK_TEST_CRASH_AT=inside_barrier_before_commit: it kills itself inside the write's
transaction, after the claim, with the resource's lock held) takes one auto-approved update
of its own resource, and dies. The Procfile's two workers and its cron process keep running
with default settings (a 30 s lock, a 32 s lease); the figure is the time from the death to
the action `applied`. The kills run one after the other, each after the last has recovered,
so that each meets the reconciler and the presence beats at a phase of its own.

Routing one write to one doomed worker: the update is proposed under an engaged kill switch
on its resource (recorded `paused`, no job), then the switch row is released and the action
queued in one transaction (what a release does, without its enqueue), and its one job is
put on the doomed worker's queue with the outbox's marker, as the outbox would on `default`.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import TYPE_CHECKING, Any

from django.db import transaction
from rq import Queue

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
DEATH_TIMEOUT_SECONDS = 60.0
RECOVERY_TIMEOUT_SECONDS = 90.0


def worker_kill_recovery(b: Bench) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    names = [f"kill-{tag}-{i}" for i in range(b.size.worker_kills)]
    fixtures.create_resources(b.core, "bench-core", names, {"n": 0})
    person = Actor.person(b.world.admin)
    for name in names:
        kill_switch_set(scope=f"bench-core/{name}", engaged=True, reason="bench", actor=person)
    actions = [
        fixtures.propose(b.core, "bench-core", name, {"n": 1}, if_match='"1"') for name in names
    ]
    if any(action.status != ActionStatus.PAUSED for action in actions):
        raise RuntimeError("the updates proposed under their kill switches were not paused")
    queues = [f"bench-kill-{tag}-{i}" for i in range(len(names))]
    for queue in queues:  # all booting at once; each waits for its one job
        b.stack.start_doomed_worker(queue, CRASH_AT)
    samples: list[float] = []
    errors: list[str] = []
    for index, (name, action, queue) in enumerate(zip(names, actions, queues, strict=True)):
        outcome = _kill_once(b, index, name, action, queue)
        if isinstance(outcome, str):
            errors.append(outcome)
        else:
            samples.append(outcome)
    log(f"worker kills: recovered after {samples} s; errors {errors}")
    p50 = round(statistics.median(samples), 1) if samples else None
    worst = round(max(samples), 1) if samples else None
    detail = {"samples_s": samples, "crash_at": CRASH_AT, "problems": errors}
    return {
        "worker_kill_recovery_p50_s": figure(
            "worker_kill_recovery_p50_s", p50, errors=len(errors), kills=len(names), **detail
        ),
        "worker_kill_recovery_max_s": figure(
            "worker_kill_recovery_max_s", worst, errors=len(errors), kills=len(names)
        ),
    }


def _kill_once(b: Bench, index: int, name: str, action: Action, queue: str) -> float | str:
    """Route the action to the doomed worker `index`; the seconds from its death to the write
    applied, or what went wrong."""
    with transaction.atomic():
        KillSwitch.objects.filter(scope=f"bench-core/{name}").update(engaged=False)
        Action.objects.filter(pk=action.pk, status=ActionStatus.PAUSED).update(
            status=ActionStatus.QUEUED, paused_reason=""
        )
    job_id = f"airlock-action-{action.pk}-{uuid.uuid4().hex[:12]}"
    connection = engine_redis()
    pipe = connection.pipeline()
    Queue(queue, connection=connection).enqueue(
        EXECUTE_ACTION_JOB, str(action.pk), job_id=job_id, result_ttl=0, pipeline=pipe
    )
    pipe.set(marker_key("action", action.pk), job_id, ex=3600)
    pipe.execute()
    doomed = b.stack.processes["doomed"][index]
    deadline = time.monotonic() + DEATH_TIMEOUT_SECONDS
    while doomed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    killed_at = time.monotonic()
    if doomed.returncode != -9:
        return f"{name}: the worker did not die by SIGKILL in its write ({doomed.returncode})"
    deadline = killed_at + RECOVERY_TIMEOUT_SECONDS
    status: str = ActionStatus.EXECUTING
    while time.monotonic() < deadline:
        status = Action.objects.values_list("status", flat=True).get(pk=action.pk)
        if status != ActionStatus.EXECUTING and status != ActionStatus.QUEUED:
            break
        time.sleep(0.05)
    recovered = round(time.monotonic() - killed_at, 2)
    applied = ResourceVersion.objects.filter(action_id=action.pk).count()
    events = AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).count()
    if status != ActionStatus.APPLIED or applied != 1 or events != 1:
        return f"{name}: {status} after {recovered} s, {applied} versions, {events} events"
    return recovered
