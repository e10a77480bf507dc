"""Tokens: personal tokens for everyone; agents and agent tokens for admins (shown once)."""

from __future__ import annotations

import re

import pytest

from approvals.models import Agent, AgentToken, PersonalToken
from approvals.services.tokens import principal_for_token
from audit.models import AuditEvent
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


def _secret(html: str) -> str:
    return html.split('<code id="new-secret">')[1].split("</code>")[0]


def test_a_person_creates_a_personal_token_shown_once(people: People) -> None:
    client = client_for(people.owner)
    response = client.post("/tokens/personal/", {"label": "laptop"})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    secret = _secret(response.content.decode())
    assert secret.startswith("pt_")
    principal = principal_for_token(secret)
    assert principal is not None
    again = client.get("/tokens/").content.decode()
    assert secret not in again and "laptop" in again
    assert secret not in str(list(AuditEvent.objects.values_list("details", flat=True)))


def test_a_person_revokes_only_their_own_token(people: People) -> None:
    client_for(people.owner).post("/tokens/personal/", {"label": "laptop"})
    token = PersonalToken.objects.get(user=people.owner)
    assert (
        client_for(people.operator).post(f"/tokens/personal/{token.pk}/revoke/").status_code == 404
    )
    response = client_for(people.owner).post(f"/tokens/personal/{token.pk}/revoke/")
    assert response.status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None
    client_for(people.owner).post(f"/tokens/personal/{token.pk}/revoke/")
    assert AuditEvent.objects.filter(event_type="token.revoked").count() == 1


def test_a_token_needs_a_label(people: People) -> None:
    response = client_for(people.owner).post("/tokens/personal/", {"label": ""})
    assert response.status_code == 422
    assert not PersonalToken.objects.exists()


def test_an_admin_creates_an_agent_and_another_token(people: People, world: World) -> None:
    client = client_for(people.admin)
    response = client.post(
        "/tokens/agents/", {"name": "deploy-bot", "description": "ships", "owner": "pat"}
    )
    assert response.status_code == 200
    assert _secret(response.content.decode()).startswith("ak_")
    agent = Agent.objects.get(name="deploy-bot")
    assert agent.owner == people.owner
    more = client.post(f"/tokens/agents/{agent.id}/tokens/", {"label": "ci"})
    assert _secret(more.content.decode()).startswith("ak_")
    assert AgentToken.objects.filter(agent=agent).count() == 2
    token = AgentToken.objects.get(agent=agent, label="ci")
    assert client.post(f"/tokens/agent-tokens/{token.pk}/revoke/").status_code == 302


def test_a_duplicate_agent_name_is_a_form_error(people: People, world: World) -> None:
    response = client_for(people.admin).post("/tokens/agents/", {"name": "ops-bot"})
    assert response.status_code == 422
    assert "already exists" in response.content.decode()


def test_only_admins_create_agents(people: People, world: World) -> None:
    client = client_for(people.operator)
    assert "Only admins create agents" in client.get("/tokens/").content.decode()
    assert client.post("/tokens/agents/", {"name": "sneaky"}).status_code == 403
    assert client.post(f"/tokens/agents/{world.agent.id}/tokens/", {}).status_code == 403
    assert not Agent.objects.filter(name="sneaky").exists()


def test_an_unknown_agent_owner_is_a_form_error(people: People, world: World) -> None:
    response = client_for(people.admin).post("/tokens/agents/", {"name": "x-bot", "owner": "ghost"})
    assert response.status_code == 422
    assert "No active person is called ghost" in response.content.decode()
    assert not Agent.objects.filter(name="x-bot").exists()


HX = {"HTTP_HX_REQUEST": "true"}


def test_with_htmx_creating_a_token_swaps_the_page_fragment(people: People) -> None:
    response = client_for(people.owner).post("/tokens/personal/", {"label": "ci"}, **HX)
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    html = response.content.decode()
    assert "<html" not in html and 'id="tokens-page"' in html
    assert _secret(html).startswith("pt_")
    assert "tokens-changed" in response["HX-Trigger"]
    assert AuditEvent.objects.filter(event_type="token.created").count() == 1


def test_with_htmx_revoking_twice_says_so_and_audits_once(people: People) -> None:
    client = client_for(people.owner)
    client.post("/tokens/personal/", {"label": "laptop"})
    token = PersonalToken.objects.get(user=people.owner)
    first = client.post(f"/tokens/personal/{token.pk}/revoke/", **HX)
    assert first.status_code == 200 and "<html" not in first.content.decode()
    assert f"Token {token.prefix}… revoked." in first.content.decode()
    assert "tokens-changed" in first["HX-Trigger"]
    second = client.post(f"/tokens/personal/{token.pk}/revoke/", **HX)
    assert "was already revoked" in second.content.decode()
    assert AuditEvent.objects.filter(event_type="token.revoked").count() == 1


def test_with_htmx_bad_input_is_a_422_fragment_without_a_trigger(
    people: People, world: World
) -> None:
    client = client_for(people.admin)
    response = client.post("/tokens/agents/", {"name": "ops-bot"}, **HX)
    assert response.status_code == 422 and "HX-Trigger" not in response
    html = response.content.decode()
    assert "<html" not in html and "already exists" in html
    assert Agent.objects.filter(name="ops-bot").count() == 1
    label = client.post(f"/tokens/agents/{world.agent.id}/tokens/", {"label": "x" * 101}, **HX)
    assert label.status_code == 422 and "at most 100 characters" in label.content.decode()
    assert not AgentToken.objects.filter(agent=world.agent).exists()


def test_every_tokens_form_posts_with_htmx_and_without(people: People, world: World) -> None:
    AgentToken.objects.create(agent=world.agent, prefix="ak_test1", token_hash="h" * 64)
    client_for(people.admin).post("/tokens/personal/", {"label": "laptop"})
    html = client_for(people.admin).get("/tokens/").content.decode()
    forms = re.findall(r"<form [^>]*>", html)
    posts = [f for f in forms if 'method="post"' in f and "logout" not in f]
    assert len(posts) == 5
    for form in posts:
        action = re.search(r'action="([^"]+)"', form)
        assert action and f'hx-post="{action.group(1)}"' in form
