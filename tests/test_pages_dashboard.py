"""Dashboard counts, the kill switch and its banner."""

from __future__ import annotations

import json
from typing import Any

import pytest

from audit.models import AuditEvent
from console.models import KillSwitch
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


def _count(html: str, element_id: str) -> str:
    start = html.index(f'id="{element_id}">') + len(f'id="{element_id}">')
    return html[start : html.index("<", start)]


def test_the_dashboard_counts_what_waits_for_an_operator(people: People, world: World) -> None:
    html = client_for(people.operator).get("/").content.decode()
    assert _count(html, "count-pending") == "2"  # one run approval, one call approval
    assert _count(html, "count-conflicts-mine") == "0"
    assert _count(html, "count-conflicts-all") == "1"


def test_a_release_owner_sees_the_conflict_as_theirs(people: People, world: World) -> None:
    html = client_for(people.release_owner).get("/").content.decode()
    assert _count(html, "count-conflicts-mine") == "1"
    assert _count(html, "count-pending") == "0"
    assert "only operators decide approvals" in html


def test_the_counts_fragment_is_a_fragment_that_polls(people: People, world: World) -> None:
    response = client_for(people.operator).get("/dashboard/counts/", HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200
    assert "<html" not in html and 'id="counts"' in html and "every 3s" in html


def test_the_dashboard_costs_a_bounded_number_of_queries(
    people: People, world: World, django_assert_max_num_queries: object
) -> None:
    client = client_for(people.operator)
    with django_assert_max_num_queries(16):  # type: ignore[operator]
        assert client.get("/").status_code == 200


def _engage(client: Any) -> Any:
    data = {"action": "engage", "scope": "*", "reason": "incident 42", "confirm": "on"}
    return client.post("/kill-switch/", data)


def test_an_operator_engages_the_kill_switch_and_the_banner_shows_everywhere(
    people: People, world: World
) -> None:
    client = client_for(people.operator)
    response = _engage(client)
    assert response.status_code == 302
    switch = KillSwitch.objects.get(scope="*")
    assert (
        switch.engaged and switch.reason == "incident 42" and switch.changed_by == people.operator
    )
    assert AuditEvent.objects.filter(event_type="kill_switch.engaged").count() == 1
    for path in ["/", "/runs/", "/resources/"]:
        html = client_for(people.auditor).get(path).content.decode()
        assert 'class="banner"' in html and "incident 42" in html
    banner = client.get("/kill-switch/banner/", HTTP_HX_REQUEST="true").content.decode()
    assert 'class="banner"' in banner and "<html" not in banner

    released = client.post(
        "/kill-switch/", {"action": "release", "scope": "*", "reason": "", "confirm": "on"}
    )
    assert released.status_code == 302
    assert 'class="banner"' not in client.get("/").content.decode()
    assert AuditEvent.objects.filter(event_type="kill_switch.released").count() == 1


def test_engaging_twice_writes_one_audit_event(people: People, world: World) -> None:
    client = client_for(people.operator)
    _engage(client)
    _engage(client)
    assert AuditEvent.objects.filter(event_type="kill_switch.engaged").count() == 1


def test_the_kill_switch_by_htmx_swaps_its_card_and_fires_the_counts_event(
    people: People, world: World
) -> None:
    client = client_for(people.operator)
    response = client.post(
        "/kill-switch/",
        {"action": "engage", "scope": "notification-policy/prod-*", "reason": "r", "confirm": "on"},
        HTTP_HX_REQUEST="true",
    )
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html and 'id="killswitch"' in html
    assert "counts-changed" in json.loads(response["HX-Trigger"])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"scope": "*", "reason": "x"}, "Tick the confirmation box"),
        ({"scope": "*", "reason": "", "confirm": "on"}, "Say why"),
        ({"scope": "not a scope!", "reason": "x", "confirm": "on"}, "Scope must be"),
    ],
)
def test_bad_kill_switch_input_is_refused_with_a_reason(
    people: People, world: World, data: dict[str, str], message: str
) -> None:
    response = client_for(people.operator).post("/kill-switch/", {"action": "engage", **data})
    assert response.status_code == 422
    assert message in response.content.decode()
    assert not KillSwitch.objects.exists()


@pytest.mark.parametrize("who", ["owner", "auditor", "outsider"])
def test_only_operators_touch_the_kill_switch(people: People, world: World, who: str) -> None:
    client = client_for(getattr(people, who))
    assert "Only operators and admins may" in client.get("/").content.decode()
    assert _engage(client).status_code == 403
    assert not KillSwitch.objects.exists()


def test_the_nav_badges_count_what_waits_for_me(people: People, world: World) -> None:
    operator = client_for(people.operator)
    html = operator.get("/nav/counts/approvals/", HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in html and 'data-count="2"' in html and "nav-count-" not in html
    rita = client_for(people.release_owner)
    assert 'data-count="1"' in rita.get("/nav/counts/conflicts/").content.decode()
    assert "badge" not in rita.get("/nav/counts/approvals/").content.decode()
    assert operator.get("/nav/counts/bogus/").status_code == 404


def test_pauses_are_grouped_by_reason(people: People, world: World) -> None:
    from approvals.models import Action

    Action.objects.filter(pk=world.action.pk).update(status="paused", paused_reason="incident 7")
    html = client_for(people.operator).get("/").content.decode()
    assert '<td>incident 7</td><td class="num">1</td>' in html
    assert _count(html, "count-paused") == "1"


def test_the_kill_switch_notice_shows_where_it_was_used_not_on_the_next_page(
    people: People, world: World
) -> None:
    client = client_for(people.operator)
    swapped = client.post(
        "/kill-switch/",
        {"action": "engage", "scope": "dns-record/*", "reason": "r", "confirm": "on"},
        HTTP_HX_REQUEST="true",
    ).content.decode()
    assert "Kill switch engaged for dns-record/*." in swapped
    # Nothing was left behind for the next page (it used to show there; the banner that
    # every page shows while a switch is engaged words it differently).
    for path in ["/runs/", "/"]:
        assert "Kill switch engaged for dns-record/*." not in client.get(path).content.decode()

    # A plain form (no JavaScript) redirects: the dashboard it lands on shows it, once.
    client.post(
        "/kill-switch/",
        {"action": "release", "scope": "dns-record/*", "reason": "", "confirm": "on"},
    )
    assert "Kill switch released for dns-record/*." in client.get("/").content.decode()
    assert "Kill switch released for" not in client.get("/runs/").content.decode()
