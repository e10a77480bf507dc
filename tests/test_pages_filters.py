"""Search and filters of the console (issue 43): conflicts by class, resolver group and
age; the audit trail by an event type chosen from a list; the header's global search."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Action
from ownership.models import Conflict, ConflictClass
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


def _old_platform_conflict(world: World) -> Conflict:
    """A second conflict: another class, routed to platform, opened two days ago."""
    shared = ConflictClass.objects.get(slug="replace_shared_document")
    action = Action.objects.create(
        run=world.run,
        agent=world.agent,
        kind=world.kind,
        name="prod-alerts",
        resource=world.resource,
        operation="update",
        payload_format="replace",
        payload={"oncall": "team-c"},
        observed_version=1,
        conflict_class=shared,
        status="conflict",
    )
    conflict = Conflict.objects.create(
        action=action,
        resource=world.resource,
        conflict_class=shared,
        resolver="owner",
        resolver_group="platform",
        base_version=1,
        current_version=2,
    )
    Conflict.objects.filter(pk=conflict.pk).update(created_at=timezone.now() - timedelta(days=2))
    return conflict


def _listed(html: str, *conflicts: Conflict) -> list[bool]:
    return [f"/conflicts/{c.id}/" in html for c in conflicts]


def test_conflicts_filter_by_class_resolver_group_and_age(people: People, world: World) -> None:
    old = _old_platform_conflict(world)
    client = client_for(people.operator)
    assert _listed(client.get("/conflicts/?scope=all").content.decode(), world.conflict, old) == [
        True,
        True,
    ]
    by_class = client.get("/conflicts/?scope=all&class=replace_shared_document").content.decode()
    assert _listed(by_class, world.conflict, old) == [False, True]
    by_group = client.get("/conflicts/?scope=all&group=release-owners").content.decode()
    assert _listed(by_group, world.conflict, old) == [True, False]
    older = client.get("/conflicts/?scope=all&age=1d").content.decode()
    assert _listed(older, world.conflict, old) == [False, True]
    nothing = client.get("/conflicts/?scope=all&age=7d").content.decode()
    assert _listed(nothing, world.conflict, old) == [False, False]
    assert "No conflicts match these filters." in nothing
    # The form offers the classes and the resolver groups as choices, the chosen one kept.
    assert '<option value="replace_shared_document">' in by_group
    assert '<option value="release-owners" selected>' in by_group
    assert '<option value="1d" selected>older than a day</option>' in older


def test_conflict_filters_answer_htmx_with_the_list_alone(people: People, world: World) -> None:
    old = _old_platform_conflict(world)
    response = client_for(people.operator).get(
        "/conflicts/?scope=all&group=platform", HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html and 'id="conflict-list"' in html
    assert _listed(html, world.conflict, old) == [False, True]


def test_the_audit_event_type_is_chosen_from_the_types_the_trail_holds(
    people: People, world: World
) -> None:
    world.audit("write.applied")
    world.audit("write.refused")
    world.audit("approval.approved")
    client = client_for(people.auditor)
    html = client.get("/audit/").content.decode()
    select = html.split('<select name="type"')[1].split("</select>")[0]
    assert '<option value="" selected>any event type</option>' in select
    assert '<optgroup label="write">' in select
    assert '<option value="write.*">every write event</option>' in select
    assert '<option value="write.refused">write.refused</option>' in select
    assert '<option value="approval.approved">approval.approved</option>' in select
    chosen = client.get("/audit/?type=write.refused").content.decode()
    assert '<option value="write.refused" selected>' in chosen
    assert "<code>write.refused</code>" in chosen and "<code>write.applied</code>" not in chosen
    # A bookmarked type the trail does not hold yet still shows as the chosen one.
    later = client.get("/audit/?type=plan.proposed").content.decode()
    assert '<option value="plan.proposed" selected>plan.proposed</option>' in later


def test_the_audit_filters_name_actor_resource_and_time_range(people: People, world: World) -> None:
    html = client_for(people.auditor).get("/audit/").content.decode()
    for label in ("Actor: agent", "Actor: person", "Resource", "From (UTC)", "Until (UTC)"):
        assert f">{label}:</label>" in html, label


def test_the_global_search_finds_by_id_prefix_and_by_name(people: People, world: World) -> None:
    client = client_for(people.operator)
    header = client.get("/").content.decode()
    assert '<form class="global-search" method="get" action="/search/" role="search"' in header

    run_prefix = str(world.run.id)[:8]
    html = client.get(f"/search/?q={run_prefix}").content.decode()
    assert f'href="/runs/{world.run.id}/"' in html

    action_prefix = str(world.action.id)[:6].upper()  # case and length do not matter
    html = client.get(f"/search/?q={action_prefix}").content.decode()
    assert f'href="/actions/{world.action.id}/"' in html

    html = client.get(f"/search/?q={str(world.conflict.id)[:8]}").content.decode()
    assert f'href="/conflicts/{world.conflict.id}/"' in html

    by_name = client.get("/search/?q=alerts").content.decode()
    assert f'href="/resources/{world.resource.identifier}/"' in by_name
    by_identifier = client.get("/search/?q=notification-policy/prod").content.decode()
    assert f'href="/resources/{world.resource.identifier}/"' in by_identifier
    by_agent = client.get("/search/?q=ops-bot").content.decode()
    assert f'href="/runs/{world.run.id}/"' in by_agent


def test_a_full_id_opens_its_page_and_nothing_is_said_plainly(people: People, world: World) -> None:
    client = client_for(people.operator)
    response = client.get(f"/search/?q={world.action.id}")
    assert response.status_code == 302 and response["Location"] == f"/actions/{world.action.id}/"
    nothing = client.get("/search/?q=zzzz-nothing").content.decode()
    assert "Nothing you may read matches" in nothing
    assert client.get("/search/?q=" + "a" * 500).status_code == 200  # cut, never a 500
    assert client.get("/search/").status_code == 200


def test_the_search_shows_only_what_the_person_may_read(people: People, world: World) -> None:
    # oscar is in no group: no run, action or conflict of the world is his to read.
    html = client_for(people.outsider).get(f"/search/?q={str(world.run.id)[:8]}").content.decode()
    assert f"/runs/{world.run.id}/" not in html
    html = client_for(people.outsider).get(f"/search/?q={world.conflict.id}").content.decode()
    assert f"/conflicts/{world.conflict.id}/" not in html
