"""A person's undo, as the console offers and describes it (issue 43, item 6).

The undo button says beforehand when the undo cannot simply restore (the resource
moved past the version the write produced), and the conflict such an undo opens is
described as the person's undo: requester, reason and base, on the list and the page.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.models import Operation
from ownership.models import Conflict, Resource, ResourceVersion
from ownership.services.conflicts import conflict_open_for_undo
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


def _applied_write(world: World) -> Operation:
    """The world's action applied as version 2 of prod-alerts, inside its undo window."""
    world.action.status = "applied"
    world.action.save(update_fields=["status"])
    return Operation.objects.create(
        action=world.action,
        fence=7,
        status="done",
        base_version=1,
        result_version=2,
        undo_deadline=timezone.now() + timedelta(minutes=10),
        finished_at=timezone.now(),
    )


def _someone_writes_version_3(world: World) -> Resource:
    resource: Resource = world.resource
    resource.document = {**resource.document, "severity": "low"}
    resource.version = 3
    resource.save(update_fields=["document", "version"])
    ResourceVersion.objects.create(
        resource=resource, version=3, document=resource.document, operation="update", fence=8
    )
    return resource


def test_the_undo_button_says_when_it_will_open_a_conflict(people: People, world: World) -> None:
    operation = _applied_write(world)
    client = client_for(people.owner)
    url = f"/resources/{world.resource.identifier}/"
    plain = client.get(url).content.decode()
    assert ">Undo version 2</button>" in plain and "will open a conflict" not in plain

    _someone_writes_version_3(world)
    moved = client.get(url).content.decode()
    assert f'action="/operations/{operation.pk}/undo/"' in moved
    assert "Undo version 2 — will open a conflict: the resource moved to v3</button>" in moved
    assert f'aria-describedby="undo-moved-{operation.pk}"' in moved


def test_a_persons_undo_conflict_names_the_person_the_undo_and_its_base(
    people: People, world: World
) -> None:
    undone = _applied_write(world)
    owner = client_for(people.owner)
    assert owner.post(f"/operations/{undone.pk}/undo/", {"confirm": "on"}).status_code == 302
    undo_operation = Operation.objects.get(undo_of=undone)
    resource = _someone_writes_version_3(world)
    # What the undo job does when the barrier answers "resource moved".
    conflict: Conflict = conflict_open_for_undo(
        action=world.action,
        resource=resource,
        undone_operation=undone,
        requested_by=str((undo_operation.outcome or {})["requested_by"]),
        undo_operation=undo_operation,
    )
    assert conflict.origin == "undo" and conflict.base_version == "2"

    operator = client_for(people.operator)
    listing = operator.get("/conflicts/?scope=all").content.decode()
    row = listing.split(f"/conflicts/{conflict.id}/")[1].split("</tr>")[0]
    assert "undo by pat (a person\u2019s undo)" in row
    assert "base v2 (after the undone write) → current v3" in row
    assert "ops-bot" not in row  # the agent did not ask for this

    page = operator.get(f"/conflicts/{conflict.id}/").content.decode()
    facts = page.split('<dl class="facts">')[1].split("</dl>")[0]
    assert "<dt>Requested by</dt><dd data-requester>pat (a person\u2019s undo)</dd>" in facts
    assert "Agent\u2019s reason" not in facts and world.action.reason not in facts
    assert "undo version 2: restore the document from before it" in facts
    assert "version 2 — what the undone write produced" in facts
    assert "what the agent saw" not in page
    assert "Proposed (the undo: before the write)" in page


def test_an_agents_stale_write_still_reads_as_the_agents(people: People, world: World) -> None:
    page = client_for(people.release_owner).get(f"/conflicts/{world.conflict.id}/")
    facts = page.content.decode().split('<dl class="facts">')[1].split("</dl>")[0]
    assert "<dd data-requester>agent <code>ops-bot</code></dd>" in facts
    assert "version 1 — what the agent saw" in facts


def test_a_persons_own_reason_is_kept_and_shown_as_theirs(people: People, world: World) -> None:
    undone = _applied_write(world)
    owner = client_for(people.owner)
    too_long = owner.post(
        f"/operations/{undone.pk}/undo/",
        {"confirm": "on", "reason": "x" * 501},
        headers={"HX-Request": "true"},
    )
    assert too_long.status_code == 422 and "longer than 500" in too_long.content.decode()
    assert not Operation.objects.filter(undo_of=undone).exists()  # nothing half-done

    form = owner.get(f"/resources/{world.resource.identifier}/").content.decode()
    assert f'<label for="undo-reason-{undone.pk}"' in form and 'name="reason"' in form
    reason = "the alert rule paged the whole team at night"
    response = owner.post(f"/operations/{undone.pk}/undo/", {"confirm": "on", "reason": reason})
    assert response.status_code == 302
    undo_operation = Operation.objects.get(undo_of=undone)
    assert (undo_operation.outcome or {})["requested_reason"] == reason
    resource = _someone_writes_version_3(world)
    conflict: Conflict = conflict_open_for_undo(
        action=world.action,
        resource=resource,
        undone_operation=undone,
        requested_by=str((undo_operation.outcome or {})["requested_by"]),
        undo_operation=undo_operation,
    )
    operator = client_for(people.operator)
    page = operator.get(f"/conflicts/{conflict.id}/").content.decode()
    facts = page.split('<dl class="facts">')[1].split("</dl>")[0]
    assert f"<dt>pat\u2019s reason</dt><dd data-undo-reason>{reason}</dd>" in facts
    assert "Agent\u2019s reason" not in facts and world.action.reason not in facts

    action_page = operator.get(f"/actions/{world.action.pk}/").content.decode()
    assert f"pat\u2019s reason: \u201c<span data-undo-reason>{reason}</span>\u201d" in action_page
    audit = operator.get("/audit/?event_type=undo.requested").content.decode()
    assert f"pat\u2019s reason: \u201c{reason}\u201d" in audit


def test_a_persons_undo_without_a_reason_says_none_was_given(people: People, world: World) -> None:
    undone = _applied_write(world)
    client_for(people.owner).post(f"/operations/{undone.pk}/undo/", {"confirm": "on"})
    undo_operation = Operation.objects.get(undo_of=undone)
    conflict: Conflict = conflict_open_for_undo(
        action=world.action,
        resource=_someone_writes_version_3(world),
        undone_operation=undone,
        requested_by=str((undo_operation.outcome or {})["requested_by"]),
        undo_operation=undo_operation,
    )
    page = client_for(people.operator).get(f"/conflicts/{conflict.id}/").content.decode()
    assert '<dt>pat\u2019s reason</dt><dd class="note">none given</dd>' in page
