"""The approvals inbox's GET filters (issue 43): agent, resource prefix, class, age and
"waiting for me", carried by the live refresh; a destructive approval needs a confirmation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Approval, ApprovalDecision
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


def _shown(people: People, **query: str) -> set[str]:
    html = client_for(people.operator).get("/approvals/", query).content.decode()
    return {a.id.hex for a in Approval.objects.all() if f'id="approval-{a.id}"' in html}


def test_each_filter_keeps_only_what_it_names(people: People, world: World) -> None:
    call, run = world.approval.id.hex, world.run_approval.id.hex
    assert _shown(people) >= {call, run}
    assert _shown(people, agent="ops-bot") >= {call, run}
    assert _shown(people, agent="nobody") == set()
    assert _shown(people, resource="notification-policy/prod") == {call}
    assert _shown(people, resource="notification-policy/other") == set()
    assert _shown(people, resource="notif") == {call}
    assert _shown(people, **{"class": "replace_shared_document"}) == {call}
    assert _shown(people, **{"class": "add_unique"}) == set()
    assert _shown(people, age="1h") == set()
    Approval.objects.filter(pk=world.approval.pk).update(
        created_at=timezone.now() - timedelta(hours=2)
    )
    assert _shown(people, age="1h") == {call}
    assert _shown(people, age="bogus") >= {call, run}  # an unknown age is no filter


def test_waiting_for_me_leaves_out_what_i_already_approved(people: People, world: World) -> None:
    call, run = world.approval.id.hex, world.run_approval.id.hex
    Approval.objects.filter(pk=world.approval.pk).update(quorum=2)
    ApprovalDecision.objects.create(
        approval=world.approval, person=people.operator, decision="approve"
    )
    assert call in _shown(people)
    assert call not in _shown(people, mine="1") and run in _shown(people, mine="1")


def test_the_live_refresh_keeps_the_filters(people: People, world: World) -> None:
    olivia = client_for(people.operator)
    page = olivia.get("/approvals/", {"agent": "ops-bot", "mine": "1"}).content.decode()
    assert "agent=ops-bot&amp;mine=1" in page  # in the poller's URL
    since = (timezone.now() - timedelta(seconds=5)).isoformat()
    # A run approval arriving: shown to an unfiltered poll, not to a resource-filtered one.
    unfiltered = olivia.get("/approvals/poll/", {"since": since})
    assert unfiltered.status_code == 200 and str(world.run_approval.id) in unfiltered.text
    filtered = olivia.get(
        "/approvals/poll/", {"since": since, "resource": "notification-policy/prod"}
    )
    assert str(world.run_approval.id) not in filtered.text
    assert "resource=notification-policy%2Fprod" in filtered.text


def test_a_delete_is_approved_only_with_the_confirmation(people: People, world: World) -> None:
    world.action.operation = "delete"
    world.action.save(update_fields=["operation"])
    olivia = client_for(people.operator)
    assert 'name="confirm"' in olivia.get("/approvals/").content.decode()
    url = f"/approvals/{world.approval.id}/decision/"
    refused = olivia.post(url, {"decision": "approve"}, HTTP_HX_REQUEST="true")
    assert refused.status_code == 422 and "I confirm" in refused.content.decode()
    world.approval.refresh_from_db()
    assert world.approval.status == "pending"
    done = olivia.post(url, {"decision": "approve", "confirm": "1"}, HTTP_HX_REQUEST="true")
    assert done.status_code == 200
    world.approval.refresh_from_db()
    assert world.approval.status == "approved"


def test_the_pushed_address_names_only_the_chosen_filters(people: People, world: World) -> None:
    olivia = client_for(people.operator)
    query = {"agent": "nobody", "resource": "", "class": "", "age": ""}  # as the form sends it
    form = {"HX-Request": "true", "HX-Trigger": "approval-filters"}
    filtered = olivia.get("/approvals/", query, headers=form)
    assert filtered["HX-Push-Url"] == "/approvals/?agent=nobody"
    assert "No approvals match these filters." in filtered.content.decode()
    cleared = olivia.get("/approvals/", {"agent": ""}, headers=form)
    assert cleared["HX-Push-Url"] == "/approvals/"
    assert "Nothing is waiting for a decision." in cleared.content.decode()
    # A plain page (no htmx), or htmx from anything but the form, pushes nothing.
    assert "HX-Push-Url" not in olivia.get("/approvals/", query)
    assert "HX-Push-Url" not in olivia.get("/approvals/", query, headers={"HX-Request": "true"})
