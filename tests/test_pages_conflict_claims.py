"""Issue 43: the conflicts list shows who is on each open conflict ("On it"), kept live by
a poll that answers only the cells whose claim changed, for conflicts the person may see."""

from __future__ import annotations

import pytest

from approvals.services.claims import claim_release, claim_take
from tests.fixtures.console import People, World, client_for, make_person

pytestmark = pytest.mark.django_db


def _cell(html: str, world: World) -> str:
    start = html.index(f'id="conflict-claim-{world.conflict.id}"')
    return html[start : html.index("</span>", start)]


def _poll_url(html: str) -> str:
    marker = 'hx-get="/conflicts/claims/?'
    return html[html.index(marker) + len('hx-get="') :].split('"')[0].replace("&amp;", "&")


def test_the_list_names_who_is_on_each_open_conflict(people: People, world: World) -> None:
    rob = make_person("rob", "release-owners")
    rita = client_for(people.release_owner)
    assert "nobody yet" in _cell(rita.get("/conflicts/").content.decode(), world)
    claim_take(subject="conflict", subject_id=world.conflict.id, person=rob)
    assert "rob is on it" in _cell(rita.get("/conflicts/").content.decode(), world)
    assert "You are on it" in _cell(client_for(rob).get("/conflicts/").content.decode(), world)
    # The htmx list refresh (filters, conflicts-changed) carries the column too.
    fragment = rita.get("/conflicts/", {"scope": "all"}, headers={"HX-Request": "true"})
    assert "rob is on it" in _cell(fragment.content.decode(), world)
    # Resolved conflicts have no one on them: no column.
    resolved = rita.get("/conflicts/", {"status": "resolved"}).content.decode()
    assert "On it" not in resolved


def test_the_poll_sends_only_changed_cells_to_people_who_see_them(
    people: People, world: World
) -> None:
    rob = make_person("rob", "release-owners")
    rita = client_for(people.release_owner)
    page = rita.get("/conflicts/").content.decode()
    poll_url = _poll_url(page)
    assert rita.get(poll_url).status_code == 204  # nothing changed
    claim_take(subject="conflict", subject_id=world.conflict.id, person=rob)
    answer = rita.get(poll_url)
    assert answer.status_code == 200
    body = answer.content.decode()
    assert 'hx-swap-oob="true"' in _cell(body, world) and "rob is on it" in _cell(body, world)
    # The fresh poller carries the new state: polling with it is quiet again.
    fresh = _poll_url(body)
    assert rita.get(fresh).status_code == 204
    claim_release(subject="conflict", subject_id=world.conflict.id, person=rob)
    released = rita.get(fresh).content.decode()
    assert "nobody yet" in _cell(released, world)
    # Someone who may not see the conflict learns nothing about it.
    claim_take(subject="conflict", subject_id=world.conflict.id, person=rob)
    outsider = client_for(people.outsider).get(poll_url)
    assert outsider.status_code == 204
    assert rita.get("/conflicts/claims/", {"shown": "not-a-uuid~x"}).status_code == 204


def test_the_filter_form_pushes_only_the_chosen_filters(people: People, world: World) -> None:
    rita = client_for(people.release_owner)
    query = {"scope": "all", "status": "open", "class": "", "group": "", "age": ""}
    form = {"HX-Request": "true", "HX-Trigger": "conflict-filters"}
    answer = rita.get("/conflicts/", query, headers=form)
    assert answer["HX-Push-Url"] == "/conflicts/?scope=all&status=open"
    assert rita.get("/conflicts/", {"class": ""}, headers=form)["HX-Push-Url"] == "/conflicts/"
    # The list's own refresh (conflicts-changed) and a plain page push nothing.
    refresh = rita.get("/conflicts/", query, headers={"HX-Request": "true"})
    assert "HX-Push-Url" not in refresh
    assert "HX-Push-Url" not in rita.get("/conflicts/", query)
