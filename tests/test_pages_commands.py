"""`manage.py person_create` and `agent_create` go through the same services,
validation and audit as the People and Tokens pages."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command

from approvals.models import Agent, AgentToken, PersonalToken
from audit.models import AuditEvent
from tests.fixtures.console import People

pytestmark = pytest.mark.django_db


def _run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.mark.parametrize(
    "args",
    [
        ["ana", "--role", "operator", "--password", "short-pass"],  # under 12 characters
        ["has space", "--role", "operator"],
        ["ana", "--role", "owner", "--group", "bad group!"],
        ["ana", "--role", "owner", "--group", "operators"],  # a role group is not an owner group
    ],
)
def test_person_create_refuses_what_the_people_page_refuses(args: list[str]) -> None:
    with pytest.raises(CommandError):
        _run("person_create", *args)
    assert not User.objects.exists()
    assert not AuditEvent.objects.exists()


def test_person_create_is_audited_once_by_the_service_as_the_command() -> None:
    output = _run(
        "person_create", "ana", "--role", "operator", "--role", "owner", "--group", "platform"
    )
    token = output.strip().splitlines()[-1]
    assert token.startswith("pt_")
    person = User.objects.get(username="ana")
    assert not person.has_usable_password()  # no --password: API only
    assert set(person.groups.values_list("name", flat=True)) == {"operators", "owners", "platform"}
    created = AuditEvent.objects.get(event_type="person.created")
    assert (created.actor_type, created.actor_label) == ("system", "manage.py person_create")
    assert created.details == {
        "username": "ana",
        "roles": ["operator", "owner"],
        "groups": ["platform"],
    }
    assert not AuditEvent.objects.filter(details__icontains=token[4:]).exists()


def test_person_create_refuses_an_existing_person_unless_asked_for_a_new_token() -> None:
    _run("person_create", "ana", "--role", "operator")
    with pytest.raises(CommandError, match="already exists"):
        _run("person_create", "ana", "--role", "admin")
    assert not User.objects.get(username="ana").groups.filter(name="admins").exists()
    token = _run("person_create", "ana", "--role", "operator", "--new-token").splitlines()[-1]
    assert token.startswith("pt_")
    assert PersonalToken.objects.filter(user__username="ana").count() == 2
    assert AuditEvent.objects.filter(event_type="person.created").count() == 1


def test_agent_create_is_audited_by_the_token_service_as_the_command(people: People) -> None:
    output = _run("agent_create", "deploy-bot", "--owner", people.owner.username)
    token = output.strip().splitlines()[-1]
    agent = Agent.objects.get(name="deploy-bot")
    assert agent.owner == people.owner
    assert token.startswith(AgentToken.objects.get(agent=agent).prefix)
    created = AuditEvent.objects.get(event_type="agent.created")
    assert (created.actor_type, created.actor_label) == ("system", "manage.py agent_create")


@pytest.mark.parametrize(
    "args",
    [
        ["deploy bot"],  # not a slug
        ["deploy-bot", "--owner", "nobody"],
        ["deploy-bot", "--owner", "oscar-inactive"],  # the Tokens page wants an active owner
    ],
)
def test_agent_create_refuses_what_the_tokens_page_refuses(args: list[str], people: People) -> None:
    User.objects.filter(pk=people.outsider.pk).update(username="oscar-inactive", is_active=False)
    with pytest.raises(CommandError):
        _run("agent_create", *args)
    assert not Agent.objects.exists()
    assert not AuditEvent.objects.exists()


def test_agent_create_issues_another_token_only_when_asked() -> None:
    _run("agent_create", "deploy-bot")
    with pytest.raises(CommandError, match="--new-token"):
        _run("agent_create", "deploy-bot")
    token = _run("agent_create", "deploy-bot", "--new-token").splitlines()[-1]
    assert token.startswith("ak_")
    assert AgentToken.objects.filter(agent__name="deploy-bot").count() == 2
    assert AuditEvent.objects.filter(event_type="agent.created").count() == 1
