"""`manage.py demo` drives the real API and leaves each page something to show."""

from __future__ import annotations

import json
import subprocess
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.utils import timezone

from approvals.models import Action, Approval, Operation, Plan
from audit.chain import verify_rows
from audit.linker import audit_link
from audit.models import AuditEvent
from console.management.demo_target import GIT_RESOURCE, demo_repository
from ownership.models import Conflict, Resource, ResourceKind

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def demo_redis(private_redis, settings, tmp_path):  # type: ignore[no-untyped-def]
    # The demo's burst worker drains the real queue: give it a Redis of its own; and a data
    # folder of its own for the git repository it makes.
    settings.DATA_DIR = tmp_path / "data"
    settings.REDIS_URL = private_redis.url
    settings.RQ_QUEUES = {"default": {"URL": private_redis.url, "DEFAULT_TIMEOUT": 120}}
    return private_redis


def run_demo() -> str:
    out = StringIO()
    call_command("demo", stdout=out)
    return out.getvalue()


def test_the_demo_plays_the_design_collision_through_the_api(demo_redis) -> None:  # type: ignore[no-untyped-def]
    output = run_demo()

    policy = Resource.objects.get(kind_id="notification-policy", name="prod-alerts")
    # B's change won; A's stale full replace changed nothing.
    assert policy.version == 42
    assert policy.document == {"destinations": ["oncall@example.test"], "severity": "critical"}
    assert 'refused: current is "42"' in output

    # B's write is applied and still inside its undo window.
    applied = Action.objects.get(
        kind_id="notification-policy", name="prod-alerts", status="applied"
    )
    operation = Operation.objects.get(action=applied, undo_of__isnull=True, status="done")
    assert operation.result_version == "42"
    assert operation.undo_deadline is not None and operation.undo_deadline > timezone.now()

    # A's re-planned change waits for an operator (per-call approval).
    waiting = Action.objects.get(
        kind_id="notification-policy", name="prod-alerts", status="pending_approval"
    )
    assert waiting.observed_version == "42"
    assert Approval.objects.filter(action=waiting, status="pending").exists()

    # The second release candidate met version 8 at execution: a conflict for release owners.
    pointer = Resource.objects.get(kind_id="release-pointer", name="prod-eu")
    assert pointer.version == 8 and pointer.document["release"] == "2026.11.3"
    conflict = Conflict.objects.get(action__name="prod-eu", action__status="conflict")
    assert conflict.status == "open"
    assert conflict.conflict_class_id == "advance_pointer"

    # A change across two resources waits as one plan, for one approval, nothing run yet.
    plan = Plan.objects.get(status="pending_approval")
    assert [s.resource_identifier for s in plan.steps.order_by("position")] == [
        "release-pointer/prod-us",
        "notification-policy/release-watch",
    ]
    assert Approval.objects.filter(plan=plan, status="pending").count() == 1
    assert "two steps, one approval waiting" in output

    # People and agents were made by their services: validated and audited as the demo.
    for event_type, count in (("person.created", 3), ("agent.created", 4)):
        made = AuditEvent.objects.filter(event_type=event_type)
        assert made.count() == count and {e.actor_label for e in made} == {"demo"}

    # Both attempts on prod-alerts are in a chain that verifies.
    events = AuditEvent.objects.filter(resource="notification-policy/prod-alerts")
    assert events.count() >= 3
    audit_link()  # the Procfile's `audit` process does this within 50 ms when it runs
    assert verify_rows(AuditEvent.objects.order_by("seq")).ok


def test_running_the_demo_twice_changes_nothing(demo_redis) -> None:  # type: ignore[no-untyped-def]
    run_demo()
    actions, events = Action.objects.count(), AuditEvent.objects.count()
    assert "already loaded" in run_demo()
    assert (Action.objects.count(), AuditEvent.objects.count()) == (actions, events)


def _git(repository: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(repository), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_demo_governs_a_git_repository_under_the_data_folder(demo_redis) -> None:  # type: ignore[no-untyped-def]
    output = run_demo()

    repository = demo_repository()
    assert repository.parent == Path(settings.DATA_DIR) and (repository / "HEAD").exists()
    kind = ResourceKind.objects.get(slug="tenant-config")
    assert kind.target == "git" and kind.target_settings["repository"] == str(repository)

    # The file was seeded by a plain commit, then changed by the real flow: read through the
    # API, proposed, approved by ana, committed by the worker through the git adapter.
    on_main = json.loads(_git(repository, "show", "main:tenants/acme.json"))
    assert on_main == {"tenant": "acme", "plan": "team", "seats": 12}
    messages = _git(repository, "log", "--format=%B", "main")
    assert _git(repository, "rev-list", "--count", "main") == "2"
    action = Action.objects.get(kind=kind, name="acme.json")
    assert action.status == "applied"
    assert f"Airlock-Action: {action.pk}" in messages and "Approved-by: ana" in messages
    assert Approval.objects.get(action=action).status == "approved"

    # Airlock's mirror holds the target's token: the file's blob id at main.
    mirror = Resource.objects.get(kind=kind, name="acme.json")
    assert mirror.external_version == _git(repository, "rev-parse", "main:tenants/acme.json")
    assert mirror.document == on_main
    done = Operation.objects.get(action=action, undo_of__isnull=True, status="done")
    assert done.result_version == mirror.external_version
    assert f"tenant-bot's change to {GIT_RESOURCE} approved by ana" in output
