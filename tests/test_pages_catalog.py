"""Conflict classes and resource kinds: everyone reads, admins edit (audited)."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from ownership.models import ConflictClass, ResourceKind
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db

CLASS = {
    "slug": "rotate_secret",
    "name": "Rotate a secret",
    "description": "",
    "approval_mode": "per_call",
    "on_conflict": "request_review",
    "resolver": "group:account-owners",
    "quorum": "2",
    "undo_window_seconds": "300",
    "approval_ttl_seconds": "3600",
    "escalation_seconds": "0",
    "escalation_group": "",
}


def test_the_seeded_table_is_shown_to_everyone(people: People, world: World) -> None:
    html = client_for(people.outsider).get("/catalog/").content.decode()
    for slug in ("add_unique", "recompute_field", "advance_pointer", "access_change"):
        assert f"<code>{slug}</code>" in html
    assert "notification-policy" in html
    assert "Only admins edit the conflict-class table" in html


def test_an_admin_adds_a_class_and_it_is_audited(people: People, world: World) -> None:
    client = client_for(people.admin)
    response = client.post("/catalog/classes/", CLASS)
    assert response.status_code == 302
    row = ConflictClass.objects.get(slug="rotate_secret")
    assert row.quorum == 2 and row.resolver == "group:account-owners"
    assert AuditEvent.objects.filter(event_type="conflict_class.created").count() == 1
    edit = client.get("/catalog/?edit_class=rotate_secret").content.decode()
    assert 'value="Rotate a secret"' in edit


KIND = {
    "slug": "notification-policy",
    "description": "routes",
    "class_create": "add_unique",
    "class_update": "advance_pointer",
    "class_delete": "replace_shared_document",
    "owner_group": "platform",
    "undo_window_seconds": "120",
    "target": "managed",
    "target_url": "",
}


def test_an_admin_edits_a_kind(people: People, world: World) -> None:
    response = client_for(people.admin).post("/catalog/kinds/", KIND)
    assert response.status_code == 302
    kind = ResourceKind.objects.get(slug="notification-policy")
    assert kind.class_update_id == "advance_pointer" and kind.undo_window_seconds == 120


def test_bad_class_input_is_a_422_naming_the_field(people: People, world: World) -> None:
    response = client_for(people.admin).post(
        "/catalog/classes/", {**CLASS, "resolver": "everyone", "quorum": "0"}
    )
    assert response.status_code == 422
    html = response.content.decode()
    assert "Resolver must be agent, owner or group" in html
    assert not ConflictClass.objects.filter(slug="rotate_secret").exists()


@pytest.mark.parametrize("who", ["operator", "owner", "auditor", "outsider"])
def test_only_admins_edit(people: People, world: World, who: str) -> None:
    client = client_for(getattr(people, who))
    assert client.post("/catalog/classes/", CLASS).status_code == 403
    assert not ConflictClass.objects.filter(slug="rotate_secret").exists()
    assert client.post("/catalog/kinds/", KIND).status_code == 403
    assert ResourceKind.objects.get(slug="notification-policy").undo_window_seconds != 120
    assert not AuditEvent.objects.filter(event_type__regex=r"^(conflict_class|resource_kind)\.")


HX = {"HTTP_HX_REQUEST": "true"}


def test_with_htmx_saving_a_class_swaps_the_page_fragment(people: People, world: World) -> None:
    response = client_for(people.admin).post("/catalog/classes/", CLASS, **HX)
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" not in html and 'id="catalog-page"' in html
    assert "Conflict class rotate_secret saved." in html and "<code>rotate_secret</code>" in html
    assert "catalog-changed" in response["HX-Trigger"]
    assert AuditEvent.objects.filter(event_type="conflict_class.created").count() == 1


def test_with_htmx_bad_input_is_a_422_fragment_and_nothing_changes(
    people: People, world: World
) -> None:
    response = client_for(people.admin).post(
        "/catalog/kinds/", {"slug": "notification-policy", "class_create": "nope"}, **HX
    )
    assert response.status_code == 422 and "HX-Trigger" not in response
    assert "<html" not in response.content.decode()
    kind = ResourceKind.objects.get(slug="notification-policy")
    assert kind.owner_group == "platform"
    assert not AuditEvent.objects.filter(event_type__startswith="resource_kind.").exists()


def test_the_catalog_page_serves_its_fragment_to_htmx(people: People, world: World) -> None:
    response = client_for(people.auditor).get("/catalog/", **HX)
    html = response.content.decode()
    assert response.status_code == 200 and "<html" not in html and 'id="catalog-page"' in html
    assert "HX-Request" in response["Vary"]
