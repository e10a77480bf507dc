"""Bulk "keep current" on the conflicts list (issue 43): several open conflicts settled
with one comment, each through the resolution service on its own (its authorisation,
its audit event); a refused one is named and the others are still resolved."""

from __future__ import annotations

import pytest

from approvals.models import Action
from audit.models import AuditEvent
from ownership.models import Conflict
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


def _another_conflict(world: World, *, group: str) -> Conflict:
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
        conflict_class=world.conflict.conflict_class,
        status="conflict",
    )
    return Conflict.objects.create(
        action=action,
        resource=world.resource,
        conflict_class=world.conflict.conflict_class,
        resolver=f"group:{group}",
        resolver_group=group,
        base_version=1,
        base_document=world.conflict.base_document,
        current_version=2,
        current_document=world.conflict.current_document,
        proposed_document={"oncall": "team-c"},
        fields=world.conflict.fields,
    )


def test_only_conflicts_i_resolve_offer_a_box(people: People, world: World) -> None:
    theirs = _another_conflict(world, group="platform")
    html = client_for(people.release_owner).get("/conflicts/?scope=all").content.decode()
    assert f'value="{world.conflict.id}" form="bulk-keep"' in html
    assert f'value="{theirs.id}" form="bulk-keep"' not in html
    assert 'id="bulk-keep"' in html and 'name="comment"' in html
    resolved = client_for(people.release_owner).get("/conflicts/?status=resolved").content
    assert b'id="bulk-keep"' not in resolved


def test_keep_current_for_several_with_one_comment(people: People, world: World) -> None:
    second = _another_conflict(world, group="release-owners")
    theirs = _another_conflict(world, group="platform")
    client = client_for(people.release_owner)
    response = client.post(
        "/conflicts/keep-current/",
        {
            "conflict": [str(world.conflict.id), str(second.id), str(theirs.id)],
            "comment": "stale after the migration; current is right",
            "next": "/conflicts/?scope=all",
        },
    )
    assert response.status_code == 302 and response["Location"] == "/conflicts/?scope=all"
    for conflict in (world.conflict, second):
        conflict.refresh_from_db()
        assert conflict.status == "resolved" and conflict.resolution == "keep_current"
        assert conflict.resolution_comment == "stale after the migration; current is right"
        assert conflict.resolution_action_id is None  # keep current writes nothing
        assert conflict.resolved_by == people.release_owner
    theirs.refresh_from_db()
    assert theirs.status == "open"  # another group's: refused by the service
    events = AuditEvent.objects.filter(event_type="conflict.resolved")
    assert {e.details["conflict"] for e in events} == {str(world.conflict.id), str(second.id)}
    page = client.get("/conflicts/?scope=all").content.decode()
    assert "Kept the current document for 2 conflicts." in page
    assert f"Not resolved — conflict {str(theirs.id)[:8]}: Only the conflict" in page


def test_bulk_without_a_comment_or_a_selection_is_refused_whole(
    people: People, world: World
) -> None:
    client = client_for(people.release_owner)
    no_comment = client.post(
        "/conflicts/keep-current/", {"conflict": [str(world.conflict.id)], "comment": " "}
    )
    assert no_comment.status_code == 422
    assert "Write the comment recorded on each resolution." in no_comment.content.decode()
    nothing = client.post("/conflicts/keep-current/", {"comment": "x"})
    assert (
        nothing.status_code == 422 and "Select at least one conflict." in nothing.content.decode()
    )
    world.conflict.refresh_from_db()
    assert world.conflict.status == "open"
    # A foreign "next" is not followed; a malformed id is reported, not a 500.
    odd = client.post(
        "/conflicts/keep-current/",
        {"conflict": ["not-a-uuid"], "comment": "x", "next": "https://evil.example/"},
    )
    assert odd.status_code == 302 and odd["Location"] == "/conflicts/"
    assert (
        "Not resolved — conflict not-a-uu: No such conflict."
        in client.get("/conflicts/").content.decode()
    )


def test_the_bulk_form_returns_to_the_list_as_filtered_even_after_an_htmx_filter(
    people: People, world: World
) -> None:
    fragment = client_for(people.release_owner).get(
        "/conflicts/?scope=all&class=advance_pointer", HTTP_HX_REQUEST="true"
    )
    html = fragment.content.decode()
    assert "<html" not in html  # the list alone, as htmx swaps it
    assert (
        '<input type="hidden" name="next" value="/conflicts/?scope=all&amp;class=advance_pointer"'
        ' form="bulk-keep">' in html
    )
