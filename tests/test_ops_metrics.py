"""/metrics' operational gauges move with the work they describe (real PostgreSQL, a private
Redis): approvals waiting and close to expiry, a kill switch's age, the reconciler's repairs."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from approvals.jobs import reconcile_job
from approvals.models import Action, Approval
from audit.services import Actor
from console.services import kill_switch_set
from tests.fixtures.console import People, World

pytestmark = pytest.mark.django_db


def sample(name: str, labels: str = "") -> float:
    text = Client().get("/metrics").content.decode()
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def test_approvals_waiting_and_close_to_expiry_are_counted(
    people: People, world: World, engine_redis: Any
) -> None:
    assert sample("airlock_approvals_waiting", '{subject="action"}') == 1
    assert sample("airlock_approvals_waiting", '{subject="run"}') == 1
    assert sample("airlock_approvals_expiring_soon") == 0
    Approval.objects.filter(pk=world.approval.pk).update(
        expires_at=timezone.now() + timedelta(minutes=5),
        created_at=timezone.now() - timedelta(hours=2),
    )
    assert sample("airlock_approvals_expiring_soon") == 1
    assert sample("airlock_approval_oldest_waiting_seconds") >= 7200


def test_an_engaged_kill_switch_is_timed_by_scope(people: People, engine_redis: Any) -> None:
    kill_switch_set(
        scope="dns-record/*", engaged=True, reason="incident", actor=Actor.person(people.operator)
    )
    assert sample("airlock_kill_switch_engaged_seconds", '{scope="dns-record/*"}') >= 0


@pytest.mark.django_db(transaction=True)
def test_the_reconcilers_repairs_are_counted_across_its_passes(
    engine_world: Any, engine_redis: Any
) -> None:
    action = engine_world.proposed_create("orphan", {"ip": "10.0.0.1"})
    engine_redis.client().flushall()  # the job is lost; PostgreSQL still says queued
    # Past the outbox's grace period (a queued action may lack its job that long).
    Action.objects.filter(pk=action.pk).update(updated_at=timezone.now() - timedelta(seconds=30))
    assert reconcile_job()["requeued"] == 1  # the cron's job, as the worker runs it
    assert sample("airlock_reconciler_repairs_total", '{kind="requeued"}') == 1
    assert reconcile_job()["requeued"] == 0  # nothing more to repair: the counter stays
    assert sample("airlock_reconciler_repairs_total", '{kind="requeued"}') == 1
