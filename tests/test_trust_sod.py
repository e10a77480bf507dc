"""Issue 9, item 6 and issue 38, item 4: separation of duties covers token minting.

Whoever created an agent or minted one of its live tokens could act as the
agent, so a class that forbids owner approval keeps them out of its run and
call approvals (and conflict resolutions) as it keeps the owner out. The person
who minted the token that created a run is recorded on the run
(`Run.token_minted_by`) and stays out of that run's approvals for good: revoking
the token or letting it expire does not turn their 403 into a 200 (issue 38) —
through the API and the console, whose inbox offers them no decision. A minter
whose token is no longer live may decide for runs another token started.
"""

from __future__ import annotations

import importlib
import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.apps import apps
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from approvals.models import Agent, AgentToken, Approval, ApprovalDecision, Run, RunStatus
from approvals.services.runs import run_create
from audit.services import Actor
from tests.fixtures.api import (
    PROD_ALERTS,
    WRITE_SET,
    AgentActor,
    Person,
    ensure_api_kinds,
    make_active_run,
    make_agent_with_token,
    make_person_with_token,
)
from tests.fixtures.plans import plan_world, propose_plan, three_steps  # noqa: F401 - fixture

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


def test_a_minter_may_approve_again_a_run_another_token_started_once_theirs_ended(
    api: Any, agent: AgentActor, admin: Person, admin2: Person
) -> None:
    # The runs are created by the command line's token (run_create records no minter):
    # the admin's token is kept out only while it is live.
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
def test_a_minter_may_approve_a_call_of_a_run_another_token_started_once_theirs_ended(
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
    from engine.core.errors import Forbidden
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


# --- Issue 38, item 4: the minter of the token that created the run, for good -------------

RUN_WRITE_SET = [{"resource": "dns-record/app-web", "operations": ["update"]}]
_SECRET = re.compile(r"ak_[A-Za-z0-9_-]{20,}")


def _mint_secret(admin: Person, agent: Any) -> str:
    """An agent token minted by `admin` in the console; its secret, as the page shows it once."""
    response = _console(admin).post(f"/tokens/agents/{agent.pk}/tokens/", {"label": "mine"})
    assert response.status_code == 200, response.content
    found = _SECRET.search(response.content.decode())
    assert found is not None, response.content
    return found.group(0)


def _end_token(secret: str, ended: str, *, by: Person) -> None:
    """The token revoked (by `by`, in the console) or expired."""
    token = AgentToken.objects.get(prefix=secret[:12])
    if ended == "revoked":
        response = _console(by).post(f"/tokens/agent-tokens/{token.pk}/revoke/")
        assert response.status_code in (200, 302), response.content
        assert AgentToken.objects.get(pk=token.pk).revoked_at is not None
    else:
        AgentToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(1))
    # The token is dead: it no longer authenticates.
    assert Client().get("/api/v1/runs", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 401


def _run_by_token(api: Any, secret: str, write_set: list[dict[str, Any]]) -> dict[str, Any]:
    created = api.create_run(secret, write_set)
    assert created.status_code == 201, created.content
    return dict(json.loads(created.content))


def _run_approval_by_minted_token(api: Any, admin: Person, agent: Any) -> tuple[Approval, str]:
    """A run the admin's minted token created, waiting for its run approval; the secret."""
    secret = _mint_secret(admin, agent)
    run = _run_by_token(api, secret, RUN_WRITE_SET)
    assert run["status"] == "pending_approval"
    return Approval.objects.get(run_id=run["id"], subject="run"), secret


def _call_approval_by_minted_token(
    api: Any, admin: Person, admin2: Person, agent: Any, ended: str
) -> Approval:
    """A run the admin's minted token created, approved by someone else; the token then
    ended, and the run's per-call write waiting for its approval."""
    secret = _mint_secret(admin, agent)
    run = _run_by_token(api, secret, WRITE_SET)
    run_approval = Approval.objects.get(run_id=run["id"], subject="run")
    assert _decide(api, admin2, run_approval).status_code == 200
    assert Run.objects.get(pk=run["id"]).status == RunStatus.ACTIVE
    _end_token(secret, ended, by=admin)
    # The run's own token outlives the agent token that created it.
    action = api.accepted_write(
        run["token"], "put", PROD_ALERTS, {"severity": "critical"}, if_match='"41"'
    )
    return Approval.objects.get(action_id=action["id"])


def test_a_run_records_the_minter_of_the_token_that_created_it(
    api: Any, agent: AgentActor, admin: Person
) -> None:
    minted = _run_by_token(api, _mint_secret(admin, agent.agent), RUN_WRITE_SET)
    assert Run.objects.get(pk=minted["id"]).token_minted_by_id == admin.user.pk
    # The command line's token (agent_create with a system actor) names no person.
    other = _run_by_token(
        api, agent.token, [{"resource": "dns-record/app-db", "operations": ["update"]}]
    )
    assert Run.objects.get(pk=other["id"]).token_minted_by_id is None


@pytest.mark.parametrize("ended", ["revoked", "expired"])
def test_the_minter_stays_out_of_the_run_their_token_created_after_it_ended_api(
    api: Any, agent: AgentActor, admin: Person, admin2: Person, ended: str
) -> None:
    approval, secret = _run_approval_by_minted_token(api, admin, agent.agent)
    assert _problem_code(_decide(api, admin, approval)) == "self_approval"
    _end_token(secret, ended, by=admin)

    refused = _decide(api, admin, approval)
    assert refused.status_code == 403 and _problem_code(refused) == "self_approval"
    rejected = api.decide(approval.pk, "reject", token=admin.token, comment="no")
    assert rejected.status_code == 403 and _problem_code(rejected) == "self_approval"
    assert not ApprovalDecision.objects.filter(approval=approval).exists()
    accepted = _decide(api, admin2, approval)
    assert accepted.status_code == 200, accepted.content
    assert Run.objects.get(pk=approval.run_id).status == RunStatus.ACTIVE


@pytest.mark.parametrize("ended", ["revoked", "expired"])
def test_the_minter_stays_out_of_a_call_of_that_run_after_the_token_ended_api(
    api: Any, agent: AgentActor, admin: Person, admin2: Person, prod_alerts: Any, ended: str
) -> None:
    approval = _call_approval_by_minted_token(api, admin, admin2, agent.agent, ended)

    refused = _decide(api, admin, approval)
    assert refused.status_code == 403 and _problem_code(refused) == "self_approval"
    assert not ApprovalDecision.objects.filter(approval=approval).exists()
    accepted = _decide(api, admin2, approval)
    assert accepted.status_code == 200, accepted.content


def test_the_minter_stays_out_of_a_plan_of_that_run_after_the_token_was_revoked(
    api: Any,
    agent: AgentActor,
    admin: Person,
    admin2: Person,
    plan_world: Any,  # noqa: F811
) -> None:
    secret = _mint_secret(admin, agent.agent)
    run = _run_by_token(api, secret, WRITE_SET)
    run_approval = Approval.objects.get(run_id=run["id"], subject="run")
    assert _decide(api, admin2, run_approval).status_code == 200
    _end_token(secret, "revoked", by=admin)
    holder = type("RunHolder", (), {"run": Run.objects.get(pk=run["id"]), "token": run["token"]})
    proposed = propose_plan(api, holder, three_steps())
    assert proposed.status_code == 202, proposed.content
    approval = Approval.objects.get(plan_id=proposed.json()["id"])

    refused = _decide(api, admin, approval)
    assert refused.status_code == 403 and _problem_code(refused) == "self_approval"


def _inbox(person: Person) -> str:
    response = _console(person).get(reverse("approvals"))
    assert response.status_code == 200, response.content
    return str(response.content.decode())


def _offers_decision(page: str, approval: Approval) -> bool:
    """Whether the inbox page shows the approval's card with its decision form."""
    assert f'id="approval-{approval.pk}"' in page, "the approval is listed"
    return reverse("approval_decide", args=[approval.pk]) in page


@pytest.mark.parametrize("subject", ["run", "call"])
@pytest.mark.parametrize("ended", ["revoked", "expired"])
def test_the_minter_is_offered_no_decision_and_refused_in_the_console_after_the_token_ended(
    api: Any,
    agent: AgentActor,
    admin: Person,
    admin2: Person,
    prod_alerts: Any,
    subject: str,
    ended: str,
) -> None:
    if subject == "run":
        approval, secret = _run_approval_by_minted_token(api, admin, agent.agent)
        _end_token(secret, ended, by=admin)
    else:
        approval = _call_approval_by_minted_token(api, admin, admin2, agent.agent, ended)

    page = _inbox(admin)
    assert not _offers_decision(page, approval)
    assert "separation of duties" in page
    assert _offers_decision(_inbox(admin2), approval)

    decide_url = reverse("approval_decide", args=[approval.pk])
    refused = _console(admin).post(
        decide_url, {"decision": "approve", "comment": ""}, HTTP_HX_REQUEST="true"
    )
    assert refused.status_code == 403, refused.content
    assert not ApprovalDecision.objects.filter(approval=approval).exists()
    # The refused card, re-rendered, offers no decision either.
    assert decide_url not in refused.content.decode()
    accepted = _console(admin2).post(
        decide_url, {"decision": "approve", "comment": ""}, HTTP_HX_REQUEST="true"
    )
    assert accepted.status_code == 200, accepted.content
    assert Approval.objects.get(pk=approval.pk).status == "approved"


def test_the_inbox_offers_a_decision_where_the_class_allows_the_minter(
    api: Any, agent: AgentActor, admin: Person
) -> None:
    from ownership.models import ConflictClass

    ConflictClass.objects.filter(slug="recompute_field").update(forbid_agent_owner_approval=False)
    approval, _secret = _run_approval_by_minted_token(api, admin, agent.agent)
    assert _offers_decision(_inbox(admin), approval)


def test_the_minter_stays_out_of_resolving_a_conflict_of_that_run_after_revoking(
    engine_world: Any, engine_redis: Any
) -> None:
    from django.contrib.auth.models import Group

    from approvals.services.decisions import approval_decide
    from approvals.services.execution import action_execute
    from approvals.services.tokens import agent_token_create, token_revoke
    from engine.core.errors import Forbidden
    from ownership.models import Conflict, Resource, ResourceVersion
    from ownership.services.resolution import conflict_resolve

    world = engine_world
    kind = world.kind("policy", update="replace_shared_document")
    world.resource(kind, "p", {"severity": "high"})
    action = world.propose(kind, "p", payload={"severity": "low"}, observed_version=1)
    # ana, an operator who is also an admin, minted the token that created the run.
    world.operator.groups.add(Group.objects.get_or_create(name="admins")[0])
    token, _secret = agent_token_create(
        agent=world.agent, actor=Actor.person(world.operator), label="ana's"
    )
    Run.objects.filter(pk=action.run_id).update(token_minted_by=world.operator)
    approval_decide(
        approval_id=Approval.objects.get(action=action).pk,
        actor=Actor.person(world.operator2),
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
    token_revoke(token=token, actor=Actor.person(world.operator))

    with pytest.raises(Forbidden) as excinfo:
        conflict_resolve(
            conflict_id=conflict.pk, actor=Actor.person(world.operator), choice="keep_current"
        )
    assert excinfo.value.code == "self_approval"


# --- The migration's backfill of existing runs --------------------------------------------


def _backfill() -> None:
    migration = importlib.import_module("approvals.migrations.0009_run_token_minted_by")
    migration.backfill_minters(apps, None)


def test_the_backfill_records_the_one_person_whose_tokens_were_live_at_a_runs_creation(
    agent: AgentActor, admin: Person, admin2: Person
) -> None:
    from approvals.services.tokens import agent_token_create

    def run_at(moment: Any, name: str) -> Run:
        run = _pending_run(agent.agent, name)
        Run.objects.filter(pk=run.pk).update(created_at=moment)
        return run

    def token_of(person: Person, **fields: Any) -> None:
        token, _ = agent_token_create(agent=agent.agent, actor=Actor.person(person.user))
        AgentToken.objects.filter(pk=token.pk).update(**fields)

    now = timezone.now()
    day = timedelta(days=1)
    before_any = run_at(now - 10 * day, "app-a")
    adams = run_at(now - 5 * day, "app-b")
    both = run_at(now - 2 * day, "app-c")
    after_revocation = run_at(now - day / 2, "app-d")
    # adam's token: live from day -8 to its revocation on day -1; alma's from day -3, expired
    # on day -1.5. The command line's token (agent's fixture) is live all along.
    token_of(admin, created_at=now - 8 * day, revoked_at=now - day)
    token_of(admin2, created_at=now - 3 * day, expires_at=now - 1.5 * day)

    _backfill()

    minted = dict(Run.objects.values_list("pk", "token_minted_by_id"))
    assert minted[before_any.pk] is None  # no person's token was live yet
    assert minted[adams.pk] == admin.user.pk  # adam's alone (beside the command line's)
    assert minted[both.pk] is None  # two people's tokens were live: unknown
    assert minted[after_revocation.pk] is None  # adam's was revoked, alma's expired
