"""Each verb authorises inside the service, whoever calls it (page, API, command, bench).

Before issue 10 run_revoke, token_revoke, agent_create and agent_token_create
trusted their callers; these tests call the services directly, as a new caller
would, and pin the rule each page and the API applied.
"""

from __future__ import annotations

import pytest

from approvals.models import Action, Agent, AgentToken, Approval, PersonalToken, RunStatus
from approvals.services.approval_open import approval_open_for_resolution
from approvals.services.runs import run_revoke
from approvals.services.tokens import (
    agent_create,
    agent_token_create,
    personal_token_create,
    token_revoke,
)
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import Forbidden, ValidationFailed
from ownership.models import ConflictClass
from tests.fixtures.console import People, World

pytestmark = pytest.mark.django_db


def test_it_refuses_a_run_revoke_by_anyone_but_an_operator(people: People, world: World) -> None:
    for actor in (
        Actor.person(people.owner),
        Actor.person(people.auditor),
        Actor.agent(world.agent),
        Actor.run(world.run),
    ):
        with pytest.raises(Forbidden):
            run_revoke(run=world.run, actor=actor, reason="not yours")
    world.run.refresh_from_db()
    assert world.run.status == RunStatus.ACTIVE
    assert not AuditEvent.objects.filter(event_type="run.revoked").exists()
    run_revoke(run=world.run, actor=Actor.person(people.operator), reason="token leaked")
    world.run.refresh_from_db()
    assert world.run.status == RunStatus.REVOKED


def test_it_refuses_a_run_revoke_by_a_deactivated_operator(people: People, world: World) -> None:
    actor = Actor.person(people.operator)
    people.operator.is_active = False
    people.operator.save(update_fields=["is_active"])
    with pytest.raises(Forbidden):
        run_revoke(run=world.run, actor=actor, reason="gone")


def test_it_lets_only_the_owner_revoke_a_personal_token(people: People) -> None:
    token, _secret = personal_token_create(user=people.owner, actor=Actor.person(people.owner))
    for actor in (Actor.person(people.operator), Actor.person(people.admin)):
        with pytest.raises(Forbidden):
            token_revoke(token=token, actor=actor)
    assert PersonalToken.objects.get(pk=token.pk).revoked_at is None
    assert token_revoke(token=token, actor=Actor.person(people.owner)) is True


def test_it_lets_a_person_mint_personal_tokens_only_for_themselves(people: People) -> None:
    for actor in (Actor.person(people.admin), Actor.person(people.operator)):
        with pytest.raises(Forbidden):
            personal_token_create(user=people.owner, actor=actor)
    assert not PersonalToken.objects.filter(user=people.owner).exists()
    assert not AuditEvent.objects.filter(event_type="token.created").exists()
    mine, _secret = personal_token_create(user=people.owner, actor=Actor.person(people.owner))
    by_cli, _secret = personal_token_create(user=people.owner, actor=Actor.system("cli"))
    assert {mine.user_id, by_cli.user_id} == {people.owner.pk}


def test_it_lets_only_admins_mint_and_revoke_agent_tokens(people: People, world: World) -> None:
    with pytest.raises(Forbidden):
        agent_token_create(agent=world.agent, actor=Actor.person(people.operator))
    token, _secret = agent_token_create(agent=world.agent, actor=Actor.person(people.admin))
    with pytest.raises(Forbidden):
        token_revoke(token=token, actor=Actor.person(people.operator))
    assert AgentToken.objects.get(pk=token.pk).revoked_at is None
    assert token_revoke(token=token, actor=Actor.person(people.admin)) is True


def test_it_lets_only_admins_and_the_system_create_agents(people: People) -> None:
    with pytest.raises(Forbidden):
        agent_create(name="sneaky", actor=Actor.person(people.operator))
    assert not Agent.objects.filter(name="sneaky").exists()
    agent, secret = agent_create(name="deploy-bot", actor=Actor.system("tests"), owner="pat")
    assert agent.owner == people.owner and secret.startswith("ak_")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": "deploy bot"}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"name": "ops-bot"}, "name"),  # taken by the world's agent
        ({"name": "deploy-bot", "owner": "ghost"}, "owner"),
        ({"name": "deploy-bot", "description": "d" * 1001}, "description"),
    ],
)
def test_it_validates_a_new_agent_inside_the_service(
    fields: dict[str, str], field: str, people: People, world: World
) -> None:
    with pytest.raises(ValidationFailed) as refused:
        agent_create(actor=Actor.person(people.admin), **fields)
    assert [error["field"] for error in refused.value.extra["errors"]] == [field]
    assert not AuditEvent.objects.filter(event_type="agent.created").exists()


def test_it_opens_a_quorum_resolution_approval_with_its_audit_event(
    people: People, world: World
) -> None:
    shared = ConflictClass.objects.get(slug="replace_shared_document")
    ConflictClass.objects.filter(pk=shared.pk).update(approval_mode="per_call", quorum=2)
    resolution = _resolution_action(world, shared)
    approval = approval_open_for_resolution(
        action=resolution, conflict=world.conflict, actor=Actor.person(people.owner), comment="ok"
    )
    assert (approval.status, approval.quorum, approval.from_conflict_id) == (
        "pending",
        2,
        world.conflict.pk,
    )
    assert list(approval.decisions.values_list("person_id", flat=True)) == [people.owner.pk]
    requested = AuditEvent.objects.get(event_type="approval.requested", action_id=resolution.pk)
    assert requested.details["conflict"] == str(world.conflict.pk)


def test_it_records_a_single_person_resolution_as_approved(people: People, world: World) -> None:
    pointer = ConflictClass.objects.get(slug="advance_pointer")
    resolution = _resolution_action(world, pointer)
    approval = approval_open_for_resolution(
        action=resolution, conflict=world.conflict, actor=Actor.person(people.owner), comment=""
    )
    assert (approval.status, approval.quorum) == ("approved", 1)
    assert Approval.objects.filter(action=resolution).count() == 1
    assert not AuditEvent.objects.filter(event_type="approval.requested").exists()


def _resolution_action(world: World, conflict_class: ConflictClass) -> Action:
    conflict_class.refresh_from_db()
    return Action.objects.create(
        run=world.run,
        agent=world.agent,
        kind=world.kind,
        name="prod-alerts",
        resource=world.resource,
        operation="update",
        payload_format="resolution",
        payload={"severity": "low"},
        observed_version=2,
        conflict_class=conflict_class,
        status="pending_approval",
        parent=world.conflict_action,
    )
