"""The outbox's question to RQ — which of these objects still has a job coming? — asked
of a whole backlog at once (approvals.outbox.jobs_pending), as the reconciler does every
few seconds from a worker the backlog is waiting for."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from rq.job import Job
from rq.utils import utcformat

from approvals.models import Action
from approvals.outbox import engine_redis as engine_client
from approvals.outbox import enqueue_action_execution, jobs_pending, marker_key
from approvals.services import reconcile as reconcile_module
from approvals.services.reconcile import reconcile


def _job_id(action_id: uuid.UUID) -> str:
    raw = engine_client().get(marker_key("action", action_id))
    assert raw is not None
    return bytes(raw).decode()  # type: ignore[arg-type]  # sync client


def _set_job(action_id: uuid.UUID, **fields: str) -> None:
    engine_client().hset(Job.key_for(_job_id(action_id)), mapping=fields)


def _command_calls(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def test_it_tells_each_job_state_apart_in_two_round_trips(engine_redis: Any) -> None:
    ids = {name: uuid.uuid4() for name in (
        "no_marker", "job_gone", "queued", "scheduled", "scheduled_overdue",
        "started", "started_long_ago", "failed", "finished",
    )}  # fmt: skip
    for name, action_id in ids.items():
        if name == "no_marker":
            continue
        delay = 60.0 if name.startswith("scheduled") else 0.0
        enqueue_action_execution(action_id, delay_seconds=delay)
    engine_client().delete(Job.key_for(_job_id(ids["job_gone"])))
    now = datetime.now(UTC)
    _set_job(ids["started"], status="started", started_at=utcformat(now))
    # A worker that died mid-job (SIGKILL) leaves its job "started" forever.
    long_ago = now - timedelta(seconds=120 + 60)
    _set_job(ids["started_long_ago"], status="started", started_at=utcformat(long_ago))
    _set_job(ids["failed"], status="failed")
    _set_job(ids["finished"], status="finished")
    client = engine_redis.client()
    client.config_resetstat()

    pending = jobs_pending("action", list(ids.values()), overdue={ids["scheduled_overdue"]})

    assert pending == {ids["queued"], ids["scheduled"], ids["started"]}
    # One MGET for the markers, one HMGET a job found (pipelined): no read per object.
    calls = _command_calls(client)
    assert calls.pop("mget") == 1
    assert calls.pop("hmget") == len(ids) - 1
    assert not calls.keys() & {"get", "hget", "hgetall", "exists"}, calls


def test_nothing_to_ask_costs_nothing(engine_redis: Any) -> None:
    client = engine_redis.client()
    client.config_resetstat()
    assert jobs_pending("undo", []) == set()
    assert jobs_pending("undo", [1, 2, 3]) == set()  # no markers: no job to read
    assert _command_calls(client).get("hmget", 0) == 0


@pytest.mark.django_db
def test_a_backlog_that_lost_its_jobs_is_resent_once_across_chunks(
    engine_world: Any, engine_redis: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of 3, so seven due actions take three chunks (one of them partial).
    monkeypatch.setattr(reconcile_module, "PENDING_CHECK_CHUNK", 3)
    actions = [engine_world.proposed_create(f"lost-{n}", {"ip": f"10.0.0.{n}"}) for n in range(7)]
    engine_redis.client().flushall()
    kept = actions[4]
    enqueue_action_execution(kept.pk)  # this one's job is still coming
    ids = [a.pk for a in actions]
    Action.objects.filter(pk__in=ids).update(updated_at=timezone.now() - timedelta(seconds=10))

    assert reconcile()["requeued"] == 6
    queued = engine_redis.client().lrange("rq:queue:default", 0, -1)
    assert len(queued) == 7  # the six resent and the one kept: none twice
    assert jobs_pending("action", ids) == set(ids)
    assert reconcile()["requeued"] == 0
