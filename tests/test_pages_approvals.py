"""The approvals inbox: what an operator sees, and one decision at a time."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Approval, ApprovalDecision
from audit.models import AuditEvent
from ownership.models import Resource
from tests.fixtures.console import People, World, client_for, make_run, post_form

pytestmark = pytest.mark.django_db


def _decide_in_place(person: Any, world: World, decision: str, comment: str = "") -> Any:
    """`person` decides the world's call approval from the inbox card (an htmx POST)."""
    return client_for(person).post(
        f"/approvals/{world.approval.id}/decision/",
        {"decision": decision, "comment": comment},
        HTTP_HX_REQUEST="true",
    )


def test_an_operator_sees_run_and_call_approvals_with_the_diff(
    people: People, world: World
) -> None:
    html = client_for(people.operator).get("/approvals/").content.decode()
    # The call approval: target, operation, class, reason, versions, the diff of the result.
    assert "Call approval: update <code>notification-policy/prod-alerts</code>" in html
    assert "replace_shared_document" in html and "add the pager channel" in html
    assert "agent observed <strong>2</strong>, current is <strong>2</strong>" in html
    assert "<code>/channels</code>" in html and "&quot;pager&quot;" in html
    assert "/oncall" not in html  # unchanged fields are not in the diff
    # The run approval: agent, task, write set, TTL.
    assert "Run approval: <code>ops-bot</code>" in html and "prune stale routes" in html
    assert "0 of 1 approval so far" in html
    assert f'data-deadline="{world.approval.expires_at.isoformat()[:19]}' in html
    # One form per approval; nothing decides in bulk.
    assert html.count('name="decision" value="approve"') == 2
    buttons = re.findall(r"<button[^>]*>([^<]*)</button>", html)
    assert buttons and not [b for b in buttons if re.search(r"\ball\b", b.lower())]


def test_a_moved_resource_is_flagged_before_anyone_approves(people: People, world: World) -> None:
    Resource.objects.filter(pk=world.resource.pk).update(version=3)
    html = client_for(people.operator).get("/approvals/").content.decode()
    assert "The resource changed since the agent read it (observed 2, now 3)" in html


def test_someone_who_may_not_decide_sees_why_and_cannot_post(people: People, world: World) -> None:
    client = client_for(people.outsider)
    html = client.get("/approvals/").content.decode()
    assert "Only operators decide approvals" in html
    assert 'value="approve"' not in html
    response = client.post(
        f"/approvals/{world.approval.id}/decision/", {"decision": "approve", "comment": ""}
    )
    assert response.status_code == 404
    assert Approval.objects.get(pk=world.approval.pk).status == "pending"


def test_an_operator_approves_in_place_and_the_counters_refresh(
    people: People, world: World
) -> None:
    response = _decide_in_place(people.operator, world, "approve", "looks right")
    html = response.content.decode()
    assert response.status_code == 200
    assert "<html" not in html and f'id="approval-{world.approval.id}"' in html
    assert set(json.loads(response["HX-Trigger"])) == {"counts-changed", "approvals-changed"}
    approval = Approval.objects.get(pk=world.approval.pk)
    assert approval.status == "approved"
    world.action.refresh_from_db()
    assert world.action.status == "queued"
    # The card now shows the action's live status, polling until it is final.
    assert f'hx-get="/actions/{world.action.id}/status/"' in html
    assert AuditEvent.objects.filter(event_type="approval.approved").count() == 1


def test_a_plain_form_post_redirects_back_to_the_inbox(people: People, world: World) -> None:
    client = post_form(
        people.operator,
        f"/approvals/{world.run_approval.id}/decision/",
        {"decision": "approve", "comment": ""},
        redirects_to="/approvals/",
    )
    world.pending_run.refresh_from_db()
    assert world.pending_run.status == "active"
    assert "Decision recorded." in client.get("/approvals/").content.decode()


def test_rejecting_needs_a_comment(people: People, world: World) -> None:
    client = client_for(people.operator)
    url = f"/approvals/{world.approval.id}/decision/"
    response = client.post(url, {"decision": "reject", "comment": ""}, HTTP_HX_REQUEST="true")
    assert response.status_code == 422
    assert "Say why you reject" in response.content.decode()
    assert not ApprovalDecision.objects.exists()
    response = client.post(
        url, {"decision": "reject", "comment": "wrong channel"}, HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 200
    world.action.refresh_from_db()
    assert world.action.status == "rejected"


def test_a_bad_decision_value_is_a_422(people: People, world: World) -> None:
    response = _decide_in_place(people.operator, world, "approve-all")
    assert response.status_code == 422
    assert Approval.objects.get(pk=world.approval.pk).status == "pending"


def test_deciding_twice_is_refused_and_writes_no_second_event(people: People, world: World) -> None:
    client = client_for(people.operator)
    url = f"/approvals/{world.approval.id}/decision/"
    client.post(url, {"decision": "approve", "comment": ""}, HTTP_HX_REQUEST="true")
    events = AuditEvent.objects.count()
    again = client.post(url, {"decision": "approve", "comment": ""}, HTTP_HX_REQUEST="true")
    assert again.status_code == 409
    assert 'class="error"' in again.content.decode()
    assert AuditEvent.objects.count() == events


def test_the_inbox_costs_a_bounded_number_of_queries(
    people: People, world: World, django_assert_max_num_queries: Any
) -> None:
    for n in range(30):
        run = make_run(world.agent, status="pending_approval", task=f"task {n}")
        Approval.objects.create(
            subject="run", run=run, quorum=1, expires_at=timezone.now() + timedelta(hours=1)
        )
    client = client_for(people.operator)
    with django_assert_max_num_queries(14):
        response = client.get("/approvals/")
    html = response.content.decode()
    assert html.count('class="card approval"') == 25
    assert "Next page" in html
    next_url = html.split('class="pager"><a href="')[1].split('"')[0].replace("&amp;", "&")
    rest = client.get(f"/approvals/{next_url}").content.decode()
    assert rest.count('class="card approval"') == 7


def test_the_agents_own_owner_is_told_they_may_not_approve(people: People, world: World) -> None:
    world.agent.owner = people.operator
    world.agent.save(update_fields=["owner"])
    response = _decide_in_place(people.operator, world, "approve")
    html = response.content.decode()
    assert response.status_code == 403
    assert "<html" not in html and 'class="error"' in html
    assert Approval.objects.get(pk=world.approval.pk).status == "pending"
