"""A person's conflict resolution belongs to the person, not to the agent's run
(issue 9, item 4): exempt from the run's end and from its token's cancel and
undo; a resolution that is cancelled, rejected or expires reopens its conflict."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, Approval
from approvals.services.actions import action_cancel
from approvals.services.decisions import approval_decide, approval_expire_due
from approvals.services.execution import action_execute
from approvals.services.runs import run_expire_due, run_finish, run_revoke
from approvals.services.undo import action_undo_request
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import Forbidden
from ownership.models import ConflictClass, Resource, ResourceVersion
from ownership.services.resolution import conflict_resolve
from tests.fixtures.api import make_active_run
from tests.fixtures.engine import reject

pytestmark = pytest.mark.django_db

OURS = {"destinations": ["oncall", "backup"], "severity": "high"}
THEIRS = {"destinations": ["oncall"], "severity": "critical"}


@pytest.fixture
def world(engine_world: Any, engine_redis: Any) -> Any:
    engine_world.account_owner = engine_world.person("ali", "account-owners")
    engine_world.kind("group", update="access_change")
    return engine_world


def _conflict(world: Any, *, quorum: int, run: Any = None, name: str = "admins") -> Any:
    """The design's collision on an access_change resource, then its conflict."""
    ConflictClass.objects.filter(slug="access_change").update(quorum=quorum)
    kind = world.kind("group", update="access_change")
    world.resource(kind, name, {"destinations": ["oncall"], "severity": "high"})
    action = world.propose(kind, name, payload=OURS, observed_version=1, run=run)
    approval = Approval.objects.get(action=action)
    approval_decide(approval_id=approval.pk, actor=Actor.person(world.operator), decision="approve")
    if quorum > 1:
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(world.operator2), decision="approve"
        )
    resource = Resource.objects.get(kind=kind, name=name)
    Resource.objects.filter(pk=resource.pk).update(document=THEIRS, version=2)
    ResourceVersion.objects.create(resource=resource, version=2, document=THEIRS, operation="seed")
    assert action_execute(action_id=action.pk) == "conflict"
    action.refresh_from_db()
    return action.conflicts.get()


def _resolve(world: Any, conflict: Any) -> Action:
    resolved = conflict_resolve(
        conflict_id=conflict.pk, actor=Actor.person(world.account_owner), choice="take_proposed"
    )
    return Action.objects.get(pk=resolved.resolution_action_id)


def _reopened(conflict: Any, reason: str) -> None:
    conflict.refresh_from_db()
    assert conflict.status == "open" and conflict.resolution_action_id is None
    assert conflict.resolved_at is None and conflict.resolution == ""
    event = AuditEvent.objects.get(event_type="conflict.reopened")
    assert event.details["conflict"] == str(conflict.pk) and event.details["reason"] == reason
    original = Action.objects.get(pk=conflict.action_id)
    assert original.error["resolution"] is None


@pytest.mark.parametrize("end", ["finish", "revoke", "expire"])
def test_a_quorum_resolution_outlives_the_run_and_executes_after_the_second_vote(
    world: Any, end: str
) -> None:
    conflict = _conflict(world, quorum=2)
    resolution = _resolve(world, conflict)
    assert resolution.status == "pending_approval"
    approval = Approval.objects.get(action=resolution, status="pending")

    if end == "finish":
        run_finish(run=world.run, actor=Actor.run(world.run))
    elif end == "revoke":
        run_revoke(run=world.run, actor=Actor.person(world.operator), reason="done")
    else:
        world.run.__class__.objects.filter(pk=world.run.pk).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        assert run_expire_due() == 1
    resolution.refresh_from_db()
    approval.refresh_from_db()
    assert resolution.status == "pending_approval" and approval.status == "pending"

    approval_decide(approval_id=approval.pk, actor=Actor.person(world.operator), decision="approve")
    resolution.refresh_from_db()
    assert resolution.status == "queued"
    assert action_execute(action_id=resolution.pk) == "applied"
    resource = Resource.objects.get(name="admins")
    assert resource.version == 3 and resource.document == OURS
    conflict.refresh_from_db()
    assert conflict.status == "resolved"


def test_a_queued_resolution_is_not_cancelled_by_the_run_finishing(world: Any) -> None:
    conflict = _conflict(world, quorum=1)
    resolution = _resolve(world, conflict)
    assert resolution.status == "queued"
    run_finish(run=world.run, actor=Actor.run(world.run))
    resolution.refresh_from_db()
    assert resolution.status == "queued"
    assert action_execute(action_id=resolution.pk) == "applied"
    assert Resource.objects.get(name="admins").document == OURS


def test_the_run_token_cannot_cancel_a_resolution_over_the_api(world: Any, api: Any) -> None:
    run = make_active_run(world.agent)
    conflict = _conflict(world, quorum=2, run=run.run)
    resolution = _resolve(world, conflict)
    response = api.post(f"/api/v1/actions/{resolution.pk}/cancel", token=run.token)
    assert response.status_code == 403, response.content
    assert response.json()["code"] == "forbidden"
    with pytest.raises(Forbidden):
        action_cancel(action=resolution, actor=Actor.agent(world.agent))
    resolution.refresh_from_db()
    assert resolution.status == "pending_approval"
    conflict.refresh_from_db()
    assert conflict.status == "resolved"


def test_the_run_token_cannot_undo_a_resolution(world: Any, api: Any) -> None:
    run = make_active_run(world.agent)
    conflict = _conflict(world, quorum=1, run=run.run)
    resolution = _resolve(world, conflict)
    assert action_execute(action_id=resolution.pk) == "applied"
    with pytest.raises(Forbidden):
        action_undo_request(action_id=resolution.pk, actor=Actor.run(run.run))
    response = api.undo(resolution.pk, token=run.token, key="undo-resolution-1")
    assert response.status_code == 403, response.content
    # A person may still undo it.
    assert (
        action_undo_request(action_id=resolution.pk, actor=Actor.person(world.operator)).status
        == "pending"
    )


def test_a_rejected_resolution_reopens_the_conflict(world: Any) -> None:
    conflict = _conflict(world, quorum=2)
    resolution = _resolve(world, conflict)
    approval = Approval.objects.get(action=resolution, status="pending")
    reject(approval, world.operator, "not this")
    resolution.refresh_from_db()
    assert resolution.status == "rejected"
    _reopened(conflict, "resolution rejected")
    # The resolver group can settle it again.
    again = conflict_resolve(
        conflict_id=conflict.pk, actor=Actor.person(world.account_owner), choice="keep_current"
    )
    assert again.status == "resolved"


def test_an_expired_resolution_approval_reopens_the_conflict(world: Any) -> None:
    conflict = _conflict(world, quorum=2)
    resolution = _resolve(world, conflict)
    approval = Approval.objects.get(action=resolution, status="pending")
    later = approval.expires_at + timedelta(seconds=1)
    assert approval_expire_due(now=later)["expired"] == 1
    resolution.refresh_from_db()
    assert resolution.status == "expired"
    _reopened(conflict, "resolution approval expired")


def test_a_person_cancelling_a_resolution_reopens_the_conflict(world: Any) -> None:
    conflict = _conflict(world, quorum=2)
    resolution = _resolve(world, conflict)
    action_cancel(action=resolution, actor=Actor.person(world.operator))
    resolution.refresh_from_db()
    assert resolution.status == "cancelled"
    _reopened(conflict, "resolution cancelled")


# A settlement and its reopening are one write (ownership/reopen.py conflict_resolution_set):
# the conflicted action's note, ETag and updated_at move the same way either way.
def test_resolving_and_reopening_each_move_the_conflicted_actions_etag_and_time(
    world: Any,
) -> None:
    conflict = _conflict(world, quorum=1)
    before = Action.objects.get(pk=conflict.action_id)

    resolution = _resolve(world, conflict)
    resolved = Action.objects.get(pk=conflict.action_id)
    assert resolved.error["resolution"]["choice"] == "take_proposed"
    assert resolved.error["resolution"]["action"] == str(resolution.pk)
    assert resolved.revision == before.revision + 1
    assert resolved.updated_at > before.updated_at

    action_cancel(action=resolution, actor=Actor.person(world.operator))
    reopened = Action.objects.get(pk=conflict.action_id)
    assert reopened.error["resolution"] is None
    assert reopened.revision == resolved.revision + 1
    assert reopened.updated_at > resolved.updated_at
    conflict.refresh_from_db()
    assert conflict.status == "open" and conflict.resolved_by_id is None
    assert conflict.resolution_fields == {} and conflict.resolution_comment == ""
