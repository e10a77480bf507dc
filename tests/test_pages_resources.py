"""Resources: list by kind/prefix, detail with history diffs, ownership, undo."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Operation
from ownership.models import OwnershipRecord, Resource, ResourceVersion
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


def _applied_operation(world: World, *, deadline_in: timedelta) -> Operation:
    world.action.status = "applied"
    world.action.save(update_fields=["status"])
    return Operation.objects.create(
        action=world.action,
        fence=7,
        status="done",
        base_version=1,
        result_version=2,
        undo_deadline=timezone.now() + deadline_in,
        finished_at=timezone.now(),
    )


def test_the_list_filters_by_kind_and_prefix(people: People, world: World) -> None:
    Resource.objects.create(kind=world.kind, name="staging-alerts", owner_group="platform")
    client = client_for(people.owner)
    html = client.get("/resources/?kind=notification-policy&prefix=prod").content.decode()
    assert "notification-policy/prod-alerts" in html and "staging-alerts" not in html
    fragment = client.get("/resources/?prefix=staging", HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in fragment and "staging-alerts" in fragment


def test_the_detail_shows_document_history_with_diffs_and_ownership(
    people: People, world: World
) -> None:
    OwnershipRecord.objects.create(
        run=world.run,
        kind=world.kind,
        name="prod-",
        is_prefix=True,
        operations=["update"],
        expires_at=timezone.now() + timedelta(hours=1),
    )
    html = client_for(people.owner).get(f"/resources/{world.resource.identifier}/").content.decode()
    assert "&quot;team-b&quot;" in html  # the current document
    assert "<code>/oncall</code>" in html and "team-a" in html  # v1 -> v2 diff
    assert "first version" in html
    assert "<code>notification-policy/prod-*</code>" in html  # the prefix record covers it
    assert "fence" in html.lower()


def test_an_owner_undoes_a_write_inside_its_window(people: People, world: World) -> None:
    operation = _applied_operation(world, deadline_in=timedelta(minutes=10))
    client = client_for(people.owner)
    html = client.get(f"/resources/{world.resource.identifier}/").content.decode()
    assert f'action="/operations/{operation.pk}/undo/"' in html and "data-deadline" in html
    response = client.post(f"/operations/{operation.pk}/undo/", {"confirm": "on"})
    assert response.status_code == 302
    assert Operation.objects.filter(undo_of=operation).count() == 1
    # Asking again is the same undo, not a second one.
    client.post(f"/operations/{operation.pk}/undo/", {"confirm": "on"})
    assert Operation.objects.filter(undo_of=operation).count() == 1


def test_undo_is_absent_outside_the_window_and_refused_to_others(
    people: People, world: World
) -> None:
    late = _applied_operation(world, deadline_in=timedelta(minutes=-1))
    html = client_for(people.owner).get(f"/resources/{world.resource.identifier}/").content.decode()
    assert "No write on this resource is inside its undo window" in html
    owner = client_for(people.owner)
    refused = owner.post(f"/operations/{late.pk}/undo/", {"confirm": "on"}, follow=True)
    assert 'class="msg-error"' in refused.content.decode()
    assert not Operation.objects.filter(undo_of=late).exists()
    Operation.objects.filter(pk=late.pk).update(undo_deadline=timezone.now() + timedelta(hours=1))
    outsider = client_for(people.outsider)
    page = outsider.get(f"/resources/{world.resource.identifier}/").content.decode()
    assert "Only operators and members of <code>platform</code> may undo" in page
    assert outsider.post(f"/operations/{late.pk}/undo/", {"confirm": "on"}).status_code == 403
    assert not Operation.objects.filter(undo_of=late).exists()


def test_unknown_resources_and_operations_are_404(people: People, world: World) -> None:
    client = client_for(people.operator)
    assert client.get("/resources/notification-policy/nope/").status_code == 404
    assert client.get("/resources/no-slash/").status_code == 404
    assert client.post("/operations/999999/undo/", {"confirm": "on"}).status_code == 404


def test_resource_pages_cost_a_bounded_number_of_queries(
    people: People, world: World, django_assert_max_num_queries: Any
) -> None:
    for version in range(3, 40):
        ResourceVersion.objects.create(
            resource=world.resource,
            version=version,
            document={"n": version},
            operation="update",
            run=world.run,
        )
    client = client_for(people.operator)
    with django_assert_max_num_queries(12):
        assert client.get(f"/resources/{world.resource.identifier}/").status_code == 200
    with django_assert_max_num_queries(8):
        assert client.get("/resources/").status_code == 200


def test_undo_by_htmx_swaps_the_resource_page(people: People, world: World) -> None:
    operation = _applied_operation(world, deadline_in=timedelta(minutes=10))
    client = client_for(people.owner)
    refused = client.post(f"/operations/{operation.pk}/undo/", {}, HTTP_HX_REQUEST="true")
    assert refused.status_code == 422 and "Tick the confirmation box" in refused.content.decode()
    response = client.post(
        f"/operations/{operation.pk}/undo/", {"confirm": "on"}, HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html and 'id="resource-page"' in html
    assert "Undo of version 2 requested." in html
    assert "counts-changed" in response["HX-Trigger"]
