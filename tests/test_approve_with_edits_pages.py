"""Issue 42 §1 in the console: the "Approve with edits" form on a call approval's card,
prefilled with the proposed document, with and without htmx, CSRF protected, its errors
shown in the card with the text as typed."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from approvals.models import Action, Approval
from audit.models import AuditEvent
from ownership.models import OwnershipRecord
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def covered(world: World) -> World:
    """The world's run holds prod-alerts for update (its write set, as activation records)."""
    OwnershipRecord.objects.create(
        run=world.run,
        kind=world.kind,
        name="prod-alerts",
        operations=["update"],
        expires_at=timezone.now() + timedelta(hours=1),
    )
    return world


def _edit_url(world: World) -> str:
    return f"/approvals/{world.approval.id}/edit/"


def test_the_call_card_offers_the_edit_form_prefilled_with_the_proposal(
    people: People, covered: World
) -> None:
    html = client_for(people.operator).get("/approvals/").content.decode()
    assert "<summary>Approve with edits</summary>" in html
    assert f'action="{_edit_url(covered)}"' in html and f'hx-post="{_edit_url(covered)}"' in html
    # The agent's merge patch, as JSON in the textarea (escaped by the template).
    assert "&quot;channels&quot;: [\n    &quot;email&quot;,\n    &quot;pager&quot;" in html
    # One edit form: the run approval's card has none.
    assert html.count('name="document"') == 1


def test_an_htmx_edit_approves_the_edited_write_and_supersedes_the_original(
    people: People, covered: World
) -> None:
    document = {"channels": ["email", "sms"]}
    response = client_for(people.operator).post(
        _edit_url(covered),
        {"document": json.dumps(document), "comment": "sms, not pager"},
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 200, response.content
    html = response.content.decode()
    assert "<html" not in html and f'id="approval-{covered.approval.id}"' in html
    assert set(json.loads(response["HX-Trigger"])) == {"counts-changed", "approvals-changed"}
    covered.action.refresh_from_db()
    assert covered.action.status == "superseded"
    edited = Action.objects.get(pk=covered.action.superseded_by_id)
    assert edited.payload == document and edited.status == "queued"
    assert edited.observed_version == "2" and edited.edited_by == people.operator
    assert edited.edit is not None and edited.edit["comment"] == "sms, not pager"
    # The card shows the original as superseded.
    assert "status-superseded" in html
    edit_event = AuditEvent.objects.get(event_type="action.edited")
    assert edit_event.actor_id == str(people.operator.pk)
    assert edit_event.details["diff"] == [
        {
            "path": "/channels",
            "old": '["email", "pager"]',
            "new": '["email", "sms"]',
            "kind": "changed",
        }
    ]


def test_a_plain_form_edit_redirects_back_to_the_inbox(people: People, covered: World) -> None:
    client = client_for(people.operator)
    response = client.post(_edit_url(covered), {"document": '{"channels": ["sms"]}', "comment": ""})
    assert response.status_code == 302 and response["Location"] == "/approvals/"
    covered.action.refresh_from_db()
    assert covered.action.status == "superseded"
    assert "Approved with your edits" in client.get("/approvals/").content.decode()


@pytest.mark.parametrize(
    ("text", "status", "shown"),
    [
        pytest.param('{"channels": [', 422, "not valid JSON", id="malformed"),
        pytest.param("[1, 2]", 422, "must be a JSON object", id="not-an-object"),
        pytest.param('{"channels": ["email", "pager"]}', 422, "changes nothing", id="unchanged"),
    ],
)
@pytest.mark.parametrize("htmx", [True, False], ids=["htmx", "plain"])
def test_a_bad_edit_is_shown_in_the_card_with_the_text_as_typed_and_changes_nothing(
    people: People, covered: World, text: str, status: int, shown: str, htmx: bool
) -> None:
    actions, events = Action.objects.count(), AuditEvent.objects.count()
    headers = {"HX-Request": "true"} if htmx else {}
    response = client_for(people.operator).post(
        _edit_url(covered), {"document": text, "comment": ""}, headers=headers
    )
    assert response.status_code == status, response.content
    html = response.content.decode()
    assert ("<html" in html) is not htmx  # without JavaScript: the page, this card alone
    assert 'class="error" role="alert"' in html and shown in html, html
    assert '<details class="approve-edits" data-key-form="edit" open>' in html
    assert text.replace('"', "&quot;") in html
    assert Action.objects.count() == actions and AuditEvent.objects.count() == events
    covered.action.refresh_from_db()
    assert covered.action.status == "pending_approval"
    assert Approval.objects.get(pk=covered.approval.pk).status == "pending"


def test_an_edit_outside_the_write_set_is_refused_in_the_card(people: People, world: World) -> None:
    # No ownership record: the run does not hold prod-alerts.
    response = client_for(people.operator).post(
        _edit_url(world), {"document": '{"channels": ["sms"]}'}, HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 403
    assert "does not cover update on notification-policy/prod-alerts" in response.content.decode()
    world.action.refresh_from_db()
    assert world.action.status == "pending_approval"


def test_the_edit_form_is_csrf_protected(people: People, covered: World) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(people.operator)
    response = client.post(_edit_url(covered), {"document": '{"channels": ["sms"]}'})
    assert response.status_code == 403
    covered.action.refresh_from_db()
    assert covered.action.status == "pending_approval"


def test_someone_who_may_not_decide_cannot_edit(people: People, covered: World) -> None:
    response = client_for(people.outsider).post(
        _edit_url(covered), {"document": '{"channels": ["sms"]}'}
    )
    assert response.status_code == 404
    covered.action.refresh_from_db()
    assert covered.action.status == "pending_approval"
