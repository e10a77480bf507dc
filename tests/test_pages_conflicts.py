"""Conflicts: the list (mine by default), the three-way page, preview and resolution."""

from __future__ import annotations

import json
from typing import Any

import pytest

from approvals.models import Action
from audit.models import AuditEvent
from ownership.models import Conflict
from tests.fixtures.console import People, World, client_for, post_form

pytestmark = pytest.mark.django_db


def test_the_list_defaults_to_the_conflicts_i_may_resolve(people: People, world: World) -> None:
    mine = client_for(people.release_owner).get("/conflicts/").content.decode()
    assert f"/conflicts/{world.conflict.id}/" in mine
    operator = client_for(people.operator)
    assert f"/conflicts/{world.conflict.id}/" not in operator.get("/conflicts/").content.decode()
    everything = operator.get("/conflicts/?scope=all").content.decode()
    assert f"/conflicts/{world.conflict.id}/" in everything


def test_the_three_way_page_marks_who_changed_each_field(people: People, world: World) -> None:
    html = client_for(people.release_owner).get(f"/conflicts/{world.conflict.id}/").content.decode()
    assert "version 1 — what the agent saw" in html
    assert "version 2 — written by <code>ops-bot</code>" in html  # who wrote current, which run
    rows = {
        path: html.split(f"<code>{path}</code>")[1].split("</tr>")[0]
        for path in ("/channels", "/oncall")
    }
    assert 'class="change-agent_only"' in html.split("<code>/channels</code>")[0][-80:]
    assert 'class="change-other_only"' in html.split("<code>/oncall</code>")[0][-80:]
    # Defaults: take what only the agent changed, keep what others changed.
    assert 'value="proposed" checked' in rows["/channels"]
    assert 'value="current" checked' in rows["/oncall"]
    assert "/severity" not in html  # unchanged by anyone


def test_the_preview_shows_the_merged_document_for_the_chosen_fields(
    people: People, world: World
) -> None:
    client = client_for(people.release_owner)
    response = client.post(
        f"/conflicts/{world.conflict.id}/preview/",
        {"choice": "merge", "field:/channels": "proposed", "field:/oncall": "proposed"},
        HTTP_HX_REQUEST="true",
    )
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html and 'id="preview"' in html
    assert "&quot;sms&quot;" in html and "team-a" in html
    keep = client.post(
        f"/conflicts/{world.conflict.id}/preview/", {"choice": "keep_current"}
    ).content.decode()
    assert "team-b" in keep and "sms" not in keep


def test_a_resolver_merges_per_field_and_sees_the_new_action(people: People, world: World) -> None:
    response = client_for(people.release_owner).post(
        f"/conflicts/{world.conflict.id}/resolution/",
        {
            "choice": "merge",
            "field:/channels": "proposed",
            "field:/oncall": "current",
            "comment": "keep team-b on call",
        },
        HTTP_HX_REQUEST="true",
    )
    html = response.content.decode()
    assert response.status_code == 200, html
    assert "<html" not in html and 'id="conflict-page"' in html and 'type="radio"' not in html
    assert "conflicts-changed" in json.loads(response["HX-Trigger"])
    conflict = Conflict.objects.get(pk=world.conflict.pk)
    assert conflict.status == "resolved" and conflict.resolution == "merge"
    assert conflict.resolved_by == people.release_owner
    new_action = Action.objects.get(pk=conflict.resolution_action_id)
    assert new_action.parent_id == world.conflict_action.pk
    assert new_action.payload == {
        "channels": ["email", "sms"],
        "severity": "high",
        "oncall": "team-b",
    }
    assert f'hx-get="/actions/{new_action.id}/status/"' in html
    assert AuditEvent.objects.filter(event_type="conflict.resolved").count() == 1


def test_resolving_by_plain_form_redirects_to_the_conflict(people: People, world: World) -> None:
    page = f"/conflicts/{world.conflict.id}/"
    client = post_form(
        people.release_owner,
        f"{page}resolution/",
        {"choice": "keep_current", "comment": ""},
        redirects_to=page,
    )
    html = client.get(page).content.decode()
    assert "keep current</strong> by rita" in html and "no new write" in html


def test_someone_outside_the_resolver_group_is_told_why_and_refused(
    people: People, world: World
) -> None:
    operator = client_for(people.operator)
    html = operator.get(f"/conflicts/{world.conflict.id}/").content.decode()
    assert "Only members of <code>release-owners</code> may resolve" in html
    assert 'type="radio"' not in html
    response = operator.post(
        f"/conflicts/{world.conflict.id}/resolution/", {"choice": "take_proposed"}
    )
    assert response.status_code == 403
    assert Conflict.objects.get(pk=world.conflict.pk).status == "open"


def test_an_outsider_does_not_learn_the_conflict_exists(people: People, world: World) -> None:
    client = client_for(people.outsider)
    assert client.get(f"/conflicts/{world.conflict.id}/").status_code == 404
    assert client.post(f"/conflicts/{world.conflict.id}/preview/", {}).status_code == 404
    assert (
        client.post(f"/conflicts/{world.conflict.id}/resolution/", {"choice": "merge"}).status_code
        == 404
    )


def test_a_bad_choice_is_a_422_and_resolving_twice_a_409(people: People, world: World) -> None:
    client = client_for(people.release_owner)
    url = f"/conflicts/{world.conflict.id}/resolution/"
    bad = client.post(url, {"choice": "both"}, HTTP_HX_REQUEST="true")
    assert bad.status_code == 422
    assert client.post(url, {"choice": "keep_current"}, HTTP_HX_REQUEST="true").status_code == 200
    events = AuditEvent.objects.count()
    again = client.post(url, {"choice": "take_proposed"}, HTTP_HX_REQUEST="true")
    assert again.status_code == 409
    assert AuditEvent.objects.count() == events


def test_the_conflict_pages_cost_a_bounded_number_of_queries(
    people: People, world: World, django_assert_max_num_queries: Any
) -> None:
    client = client_for(people.release_owner)
    with django_assert_max_num_queries(12):
        assert client.get("/conflicts/?scope=all").status_code == 200
    with django_assert_max_num_queries(14):
        assert client.get(f"/conflicts/{world.conflict.id}/").status_code == 200
