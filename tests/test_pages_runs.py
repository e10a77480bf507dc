"""Runs: list with filters and keyset pages, detail with its timeline, revoke."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from approvals.models import Run
from audit.models import AuditEvent
from tests.fixtures.console import People, World, client_for, make_run

pytestmark = pytest.mark.django_db
RUN_LINK = re.compile(r'href="/runs/[0-9a-f-]{36}/"')


def test_the_run_list_filters_by_status_and_by_action_status(people: People, world: World) -> None:
    client = client_for(people.operator)
    active = client.get("/runs/?status=active").content.decode()
    assert f"/runs/{world.run.id}/" in active and f"/runs/{world.pending_run.id}/" not in active
    waiting = client.get("/runs/?action_status=pending_approval").content.decode()
    assert f"/runs/{world.run.id}/" in waiting and f"/runs/{world.pending_run.id}/" not in waiting
    fragment = client.get("/runs/?status=pending_approval", HTTP_HX_REQUEST="true")
    html = fragment.content.decode()
    assert "<html" not in html and 'id="run-list"' in html
    assert f"/runs/{world.pending_run.id}/" in html


def test_a_bad_filter_is_reported_not_a_500(people: People, world: World) -> None:
    response = client_for(people.operator).get("/runs/?status=bogus")
    assert response.status_code == 200
    assert "Select a valid choice" in response.content.decode()


def test_long_run_lists_paginate_by_keyset_with_bounded_queries(
    people: People, world: World, django_assert_max_num_queries: Any
) -> None:
    for n in range(60):
        make_run(world.agent, status="finished", task=f"batch {n}")
    client = client_for(people.auditor)
    with django_assert_max_num_queries(10):
        first = client.get("/runs/").content.decode()
    assert len(RUN_LINK.findall(first)) == 50
    cursor = first.split("cursor=")[1].split('"')[0]
    second = client.get(f"/runs/?cursor={cursor}").content.decode()
    assert len(RUN_LINK.findall(second)) == 12
    assert client.get("/runs/?cursor=garbage").status_code == 200


def test_the_run_page_shows_task_identity_write_set_and_a_live_timeline(
    people: People, world: World
) -> None:
    client = client_for(people.operator)
    html = client.get(f"/runs/{world.run.id}/").content.decode()
    assert "rotate alert routes" in html and "ops-bot" in html
    assert "<code>notification-policy/prod-alerts</code>: update" in html
    assert "Heartbeat</dt><dd>never" in html
    assert f'hx-get="/runs/{world.run.id}/"' in html and "every 3s" in html
    timeline = client.get(f"/runs/{world.run.id}/", HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in timeline and 'id="timeline"' in timeline
    assert f"/actions/{world.action.id}/" in timeline


def test_an_outsider_does_not_see_the_run(people: People, world: World) -> None:
    client = client_for(people.outsider)
    assert client.get(f"/runs/{world.run.id}/").status_code == 404
    assert f"/runs/{world.run.id}/" not in client.get("/runs/").content.decode()
    assert client.post(f"/runs/{world.run.id}/revoke/", {"reason": "x"}).status_code == 404


def test_an_operator_revokes_a_run_with_a_reason(people: People, world: World) -> None:
    client = client_for(people.operator)
    response = client.post(
        f"/runs/{world.run.id}/revoke/", {"reason": "wrong target", "confirm": "on"}
    )
    assert response.status_code == 302 and response["Location"] == f"/runs/{world.run.id}/"
    assert Run.objects.get(pk=world.run.pk).status == "revoked"
    assert AuditEvent.objects.filter(event_type="run.revoked").count() == 1
    html = client.get(f"/runs/{world.run.id}/").content.decode()
    assert "there is nothing to revoke" in html


def test_revoking_needs_a_reason_and_the_operator_role(people: People, world: World) -> None:
    operator = client_for(people.operator)
    bad = operator.post(f"/runs/{world.run.id}/revoke/", {"reason": "", "confirm": "on"})
    assert bad.status_code == 422
    auditor = client_for(people.auditor)
    assert "Only operators revoke runs" in auditor.get(f"/runs/{world.run.id}/").content.decode()
    refused = auditor.post(f"/runs/{world.run.id}/revoke/", {"reason": "x", "confirm": "on"})
    assert refused.status_code == 403
    assert Run.objects.get(pk=world.run.pk).status == "active"


def test_the_action_page_and_its_status_poller(people: People, world: World) -> None:
    client = client_for(people.operator)
    html = client.get(f"/actions/{world.action.id}/").content.decode()
    assert "add the pager channel" in html and "pending approval" in html
    assert "&quot;channels&quot;: [" in html  # the payload as JSON, not a Python repr
    poll = client.get(f"/actions/{world.action.id}/status/", HTTP_HX_REQUEST="true")
    assert poll.status_code == 200 and 'hx-trigger="every 1s"' in poll.content.decode()
    final = client.get(f"/actions/{world.conflict_action.id}/status/", HTTP_HX_REQUEST="true")
    assert final.status_code == 286  # htmx stops polling a final state
    assert "hx-trigger" not in final.content.decode()
    assert client_for(people.outsider).get(f"/actions/{world.action.id}/").status_code == 404


def test_revoking_by_htmx_swaps_the_run_page(people: People, world: World) -> None:
    client = client_for(people.operator)
    url = f"/runs/{world.run.id}/revoke/"
    bad = client.post(url, {"reason": "", "confirm": "on"}, HTTP_HX_REQUEST="true")
    assert bad.status_code == 422 and 'id="run-page"' in bad.content.decode()
    response = client.post(url, {"reason": "stop", "confirm": "on"}, HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html and 'id="run-page"' in html
    assert "Run revoked" in html and "status-revoked" in html
    assert "counts-changed" in json.loads(response["HX-Trigger"])


def test_the_timeline_stops_polling_once_the_run_ended_and_its_actions_are_final(
    people: People, world: World
) -> None:
    client = client_for(people.operator)
    Run.objects.filter(pk=world.run.pk).update(status="finished")
    url = f"/runs/{world.run.id}/"
    assert client.get(url, HTTP_HX_REQUEST="true").status_code == 200  # one action still pending
    world.action.status = "cancelled"
    world.action.save(update_fields=["status"])
    assert client.get(url, HTTP_HX_REQUEST="true").status_code == 286


def test_a_history_restore_gets_the_whole_page(people: People, world: World) -> None:
    response = client_for(people.operator).get(
        "/runs/?status=active", HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true"
    )
    assert "<html" in response.content.decode()


def test_owners_and_resolvers_see_the_runs_that_touched_their_resources(
    people: People, world: World
) -> None:
    for who in ("owner", "release_owner"):  # platform owns the resource; rita resolves
        client = client_for(getattr(people, who))
        assert client.get(f"/runs/{world.run.id}/").status_code == 200
        assert f"/runs/{world.run.id}/" in client.get("/runs/").content.decode()
    # The pending run has no action yet: only operators, admins and auditors see it.
    assert client_for(people.owner).get(f"/runs/{world.pending_run.id}/").status_code == 404
