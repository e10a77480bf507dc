"""Issue 9, item 6: separation of duties covers token minting.

Whoever created an agent or minted one of its live tokens could act as the
agent, so a class that forbids owner approval keeps them out of its run and
call approvals (and conflict resolutions) as it keeps the owner out. Revoking
the token (or its expiry) ends that: a minter whose token is no longer live is
no longer treated as the owner, unless they also created the agent.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from approvals.models import Agent, AgentToken, Approval, ApprovalDecision, Run
from approvals.services.runs import run_create
from audit.services import Actor
from tests.fixtures.api import (
    PROD_ALERTS,
    AgentActor,
    Person,
    ensure_api_kinds,
    make_active_run,
    make_agent_with_token,
    make_person_with_token,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin2(db: Any) -> Person:
    return make_person_with_token("alma", "admins")


def _console(person: Person) -> Client:
    client = Client()
    client.force_login(person.user)
    return client


def _mint(admin: Person, agent: Any) -> AgentToken:
    response = _console(admin).post(f"/tokens/agents/{agent.pk}/tokens/", {"label": "mine"})
    assert response.status_code == 200, response.content
    return AgentToken.objects.filter(agent=agent, label="mine").latest("created_at")


def _pending_run(agent: Any, name: str = "app-web") -> Run:
    run, _ = run_create(
        agent=agent,
        task="sod test",
        write_set=[{"resource": f"dns-record/{name}", "operations": ["update"]}],
        ttl_seconds=None,
        actor=Actor.agent(agent),
    )
    assert run.status == "pending_approval"
    return run


def _decide(api: Any, person: Person, approval: Approval) -> Any:
    return api.decide(approval.pk, "approve", token=person.token)


def _problem_code(response: Any) -> str:
    return str(json.loads(response.content)["code"])


def test_an_admin_who_minted_a_token_cannot_approve_the_agents_run_and_another_admin_can(
    api: Any, agent: AgentActor, admin: Person, admin2: Person
) -> None:
    token = _mint(admin, agent.agent)
    assert token.created_by_id == admin.user.pk
    approval = Approval.objects.get(run=_pending_run(agent.agent), subject="run")

    refused = _decide(api, admin, approval)
    assert refused.status_code == 403 and _problem_code(refused) == "self_approval"
    assert not ApprovalDecision.objects.filter(approval=approval).exists()

    accepted = _decide(api, admin2, approval)
    assert accepted.status_code == 200, accepted.content
    assert Run.objects.get(pk=approval.run_id).status == "active"


def test_an_admin_who_minted_a_token_cannot_approve_the_agents_per_call_action(
    api: Any, agent: AgentActor, admin: Person, admin2: Person, prod_alerts: Any
) -> None:
    run = make_active_run(agent.agent)
    _mint(admin, agent.agent)
    action = api.accepted_write(
        run.token, "put", PROD_ALERTS, {"severity": "critical"}, if_match='"41"'
    )
    approval = Approval.objects.get(action_id=action["id"])

    refused = _decide(api, admin, approval)
    assert refused.status_code == 403 and _problem_code(refused) == "self_approval"
    accepted = _decide(api, admin2, approval)
    assert accepted.status_code == 200, accepted.content


def test_a_minter_may_approve_again_once_their_token_is_revoked_or_expired(
    api: Any, agent: AgentActor, admin: Person, admin2: Person
) -> None:
    token = _mint(admin, agent.agent)
    first = Approval.objects.get(run=_pending_run(agent.agent), subject="run")
    assert _decide(api, admin, first).status_code == 403

    revoked = _console(admin2).post(f"/tokens/agent-tokens/{token.pk}/revoke/")
    assert revoked.status_code in (200, 302), revoked.content
    assert _decide(api, admin, first).status_code == 200

    # An expired token no longer speaks for the agent either.
    expired = _mint(admin, agent.agent)
    AgentToken.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(1))
    second = Approval.objects.get(run=_pending_run(agent.agent, "app-db"), subject="run")
    assert _decide(api, admin, second).status_code == 200


@pytest.mark.parametrize("ended", ["revoked", "expired"])
def test_a_minter_may_approve_a_call_once_their_token_is_no_longer_live(
    api: Any, agent: AgentActor, admin: Person, admin2: Person, prod_alerts: Any, ended: str
) -> None:
    # A call decision reads "minted a live token" in its locking statement's SQL
    # (decision_rows); a run decision through tokens.live_token (the test above): one rule.
    run = make_active_run(agent.agent)
    token = _mint(admin, agent.agent)
    if ended == "revoked":
        revoked = _console(admin2).post(f"/tokens/agent-tokens/{token.pk}/revoke/")
        assert revoked.status_code in (200, 302), revoked.content
    else:
        AgentToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(1))
    action = api.accepted_write(
        run.token, "put", PROD_ALERTS, {"severity": "critical"}, if_match='"41"'
    )
    approval = Approval.objects.get(action_id=action["id"])

    accepted = _decide(api, admin, approval)
    assert accepted.status_code == 200, accepted.content


def test_the_admin_who_created_the_agent_stays_out_even_after_revoking_its_tokens(
    api: Any, admin: Person, admin2: Person
) -> None:
    ensure_api_kinds()
    created = _console(admin).post("/tokens/agents/", {"name": "ops-bot"})
    assert created.status_code == 200, created.content
    agent = Agent.objects.get(name="ops-bot")
    assert agent.created_by_id == admin.user.pk
    for token in AgentToken.objects.filter(agent=agent):
        _console(admin2).post(f"/tokens/agent-tokens/{token.pk}/revoke/")
    assert not AgentToken.objects.filter(agent=agent, revoked_at__isnull=True).exists()
    approval = Approval.objects.get(run=_pending_run(agent), subject="run")

    refused = _decide(api, admin, approval)
    assert refused.status_code == 403 and _problem_code(refused) == "self_approval"


def test_a_token_minted_for_another_agent_does_not_keep_the_admin_out(
    api: Any, agent: AgentActor, admin: Person
) -> None:
    other = make_agent_with_token("report-bot")
    _mint(admin, other.agent)
    approval = Approval.objects.get(run=_pending_run(agent.agent), subject="run")
    assert _decide(api, admin, approval).status_code == 200


def test_a_minter_may_approve_where_the_class_allows_owner_approval(
    api: Any, agent: AgentActor, admin: Person
) -> None:
    from ownership.models import ConflictClass

    ConflictClass.objects.filter(slug="recompute_field").update(forbid_agent_owner_approval=False)
    _mint(admin, agent.agent)
    approval = Approval.objects.get(run=_pending_run(agent.agent), subject="run")
    assert _decide(api, admin, approval).status_code == 200


def test_an_agent_and_token_made_by_the_command_line_record_no_person(
    agent: AgentActor,
) -> None:
    # make_agent_with_token goes through agent_create with a system actor.
    assert agent.agent.created_by_id is None
    assert AgentToken.objects.get(agent=agent.agent).created_by_id is None


def test_a_minter_cannot_resolve_the_agents_conflict_where_the_class_forbids_it(
    engine_world: Any, engine_redis: Any
) -> None:
    from django.contrib.auth.models import Group

    from approvals.services.decisions import approval_decide
    from approvals.services.execution import action_execute
    from approvals.services.tokens import agent_token_create
    from console.core.errors import Forbidden
    from ownership.models import Conflict, Resource, ResourceVersion
    from ownership.services.resolution import conflict_resolve

    world = engine_world
    kind = world.kind("policy", update="replace_shared_document")
    world.resource(kind, "p", {"severity": "high"})
    action = world.propose(kind, "p", payload={"severity": "low"}, observed_version=1)
    approval_decide(
        approval_id=Approval.objects.get(action=action).pk,
        actor=Actor.person(world.operator),
        decision="approve",
    )
    resource = Resource.objects.get(kind=kind, name="p")
    Resource.objects.filter(pk=resource.pk).update(document={"severity": "critical"}, version=2)
    ResourceVersion.objects.create(
        resource=resource, version=2, document={"severity": "critical"}, operation="update"
    )
    assert action_execute(action_id=action.pk) == "conflict"
    action.refresh_from_db()
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    # ana, an operator who is also an admin (only admins mint agent tokens), mints a
    # token for the agent that made the write.
    world.operator.groups.add(Group.objects.get_or_create(name="admins")[0])
    agent_token_create(agent=world.agent, actor=Actor.person(world.operator), label="ana's")

    with pytest.raises(Forbidden) as excinfo:
        conflict_resolve(
            conflict_id=conflict.pk, actor=Actor.person(world.operator), choice="keep_current"
        )

    assert excinfo.value.code == "self_approval"
    conflict_resolve(
        conflict_id=conflict.pk, actor=Actor.person(world.operator2), choice="keep_current"
    )
    conflict.refresh_from_db()
    assert conflict.status == "resolved"
