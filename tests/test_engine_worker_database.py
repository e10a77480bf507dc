"""A long-lived worker (the Procfile's SimpleWorker) survives its database connection
being cut: the next job reconnects instead of failing on a dead connection."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Action, Approval
from approvals.services.decisions import approval_decide
from audit.services import Actor
from tests.fixtures.engine import wait_for
from tests.races import over_sessions

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _status(action: Action) -> str:
    return Action.objects.values_list("status", flat=True).get(pk=action.pk)


def _approve_and_wait(engine_world: Any, action: Action) -> None:
    approval = Approval.objects.get(action=action)
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    wait_for(lambda: _status(action) in {"applied", "failed"}, timeout=30)


def _cut_other_connections() -> int:
    """Terminate every other session on the test database (the worker's)."""
    return over_sessions("count(pg_terminate_backend(pid))", where="pid <> pg_backend_pid()")


def test_a_worker_whose_database_connection_was_cut_applies_the_next_job(
    engine_world: Any, engine_redis: Any, rq_worker: Any
) -> None:
    first = engine_world.proposed_critical_alert()
    worker = rq_worker()
    _approve_and_wait(engine_world, first)
    assert _status(first) == "applied", worker.output()

    assert _cut_other_connections() >= 1  # the worker held a connection open

    second = engine_world.propose(
        first.kind, "prod-alerts", payload={"severity": "low"}, observed_version=2
    )
    _approve_and_wait(engine_world, second)
    assert _status(second) == "applied", worker.output()
    assert worker.alive()
