"""The audit page: filters, links, the chain badge and the JSON Lines export."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from approvals.models import Agent
from audit.linker import audit_link
from audit.models import AuditEvent
from audit.services import Actor, audit_append
from tests.fixtures.audit import forget_verification
from tests.fixtures.console import People, World, client_for, make_run

pytestmark = pytest.mark.django_db


@pytest.fixture
def events(people: People, world: World) -> list[AuditEvent]:
    made = [
        world.audit("write.applied", details={"version": 2}),
        audit_append(
            event_type="approval.approved", actor=Actor.person(people.operator), details={}
        ),
        audit_append(event_type="kill_switch.engaged", actor=Actor.system(), resource="*"),
    ]
    audit_link()
    return list(AuditEvent.objects.filter(seq__in=[e.seq for e in made]).order_by("seq"))


def test_events_link_to_their_objects(people: People, events: list[AuditEvent]) -> None:
    html = client_for(people.auditor).get("/audit/").content.decode()
    assert f'href="/resources/{events[0].resource}/"' in html
    assert f'href="/runs/{events[0].run_id}/"' in html
    assert f'href="/actions/{events[0].action_id}/"' in html
    assert "{&quot;version&quot;: 2}" in html  # the details, as one line of JSON


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("resource=notification-policy/prod-alerts", {"write.applied"}),
        ("agent=ops-bot", {"write.applied"}),
        ("person=olivia", {"approval.approved"}),
        ("type=kill_switch.engaged", {"kill_switch.engaged"}),
        ("type=write.*", {"write.applied"}),
        ("person=nobody", set()),
        ("since=2000-01-01T00:00", {"write.applied", "approval.approved", "kill_switch.engaged"}),
        ("until=2000-01-01T00:00", set()),
    ],
)
def test_the_filters_narrow_the_events(
    people: People, events: list[AuditEvent], query: str, expected: set[str]
) -> None:
    html = client_for(people.auditor).get(f"/audit/?{query}", HTTP_HX_REQUEST="true")
    body = html.content.decode()
    assert "<html" not in body
    shown = {
        t
        for t in ("write.applied", "approval.approved", "kill_switch.engaged")
        if f"<code>{t}</code>" in body
    }
    assert shown == expected


def test_the_agent_filter_keeps_its_own_events_its_runs_and_what_others_did_in_them(
    people: People, world: World
) -> None:
    other = Agent.objects.create(name="ops-bot-2")
    other_run = make_run(other)
    for event_type, actor, run_id in (
        ("run.created", Actor.agent(world.agent), world.run.id),  # as run_create writes it
        ("token.rotated", Actor.agent(world.agent), None),
        ("approval.approved", Actor.person(people.operator), world.run.id),
        ("run.created", Actor.agent(other), other_run.id),
        ("write.refused", Actor.person(people.operator), other_run.id),
    ):
        audit_append(event_type=event_type, actor=actor, run_id=run_id)
    body = client_for(people.auditor).get("/audit/?agent=ops-bot", HTTP_HX_REQUEST="true")
    html = body.content.decode()
    assert html.count("<code>run.created</code>") == 1
    assert "<code>token.rotated</code>" in html and "<code>approval.approved</code>" in html
    assert "<code>write.refused</code>" not in html  # another agent's run


def test_a_malformed_filter_is_reported_not_a_500(people: People, events: list[AuditEvent]) -> None:
    response = client_for(people.auditor).get("/audit/?run=not-a-uuid")
    assert response.status_code == 200
    assert "Enter a valid UUID" in response.content.decode()


def test_the_chain_badge_shows_the_verified_head(people: People, events: list[AuditEvent]) -> None:
    html = client_for(people.auditor).get("/audit/verify/", HTTP_HX_REQUEST="true").content.decode()
    assert "Chain verified" in html and f"linked up to seq {events[-1].seq}" in html
    assert events[-1].hash[:16] in html


def test_the_export_is_json_lines_of_the_filtered_events(
    people: People, events: list[AuditEvent]
) -> None:
    response = client_for(people.auditor).get("/audit/export.jsonl?type=write.*")
    assert response["Content-Type"].startswith("application/jsonl")
    lines = b"".join(response.streaming_content).decode().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["event_type"] for r in rows] == ["write.applied"]
    assert rows[0]["hash"] == events[0].hash and rows[0]["details"] == {"version": 2}


@pytest.mark.parametrize("path", ["/audit/", "/audit/verify/", "/audit/export.jsonl"])
def test_the_trail_is_for_operators_admins_and_auditors(
    people: People, events: list[AuditEvent], path: str
) -> None:
    assert client_for(people.outsider).get(path).status_code == 403
    assert client_for(people.owner).get(path).status_code == 403


def test_the_audit_page_paginates_with_bounded_queries(
    people: People, world: World, django_assert_max_num_queries: Any
) -> None:
    for n in range(120):
        audit_append(event_type="test.event", actor=Actor.system(), details={"n": n})
    client = client_for(people.auditor)
    with django_assert_max_num_queries(8):
        first = client.get("/audit/").content.decode()
    assert first.count("<code>test.event</code>") == 50
    before = first.split("before=")[1].split('"')[0]
    second = client.get(f"/audit/?before={before}").content.decode()
    assert second.count("<code>test.event</code>") == 50


def test_the_badge_reuses_its_result_until_the_head_moves(
    people: People, events: list[AuditEvent]
) -> None:
    forget_verification()
    client = client_for(people.auditor)
    first = client.get("/audit/verify/").content.decode()
    assert "Chain verified</span>: linked up to seq 3" in first and "cached" not in first
    again = client.get("/audit/verify/").content.decode()
    assert "up to seq 3" in again and "cached while the head is unchanged" in again
    audit_append(event_type="test.event", actor=Actor.system())
    moved = client.get("/audit/verify/").content.decode()
    assert "up to seq 4" in moved and "cached while" not in moved
    fresh = client.get("/audit/verify/?fresh=1").content.decode()
    assert "up to seq 4" in fresh and "cached while" not in fresh


def test_the_badge_names_the_first_bad_seq_of_a_tampered_chain(
    people: People, events: list[AuditEvent]
) -> None:
    forget_verification()
    with connection.cursor() as cursor:  # the test session may bypass the append-only trigger
        cursor.execute(
            "UPDATE audit_auditevent SET details = '{\"forged\": true}' WHERE seq = %s",
            [events[1].seq],
        )
    html = client_for(people.auditor).get("/audit/verify/").content.decode()
    assert "Chain broken</span> at seq 2" in html
    assert "verified up to seq 1" in html
    forget_verification()  # do not leave a broken-chain result for the next test
