"""Auto-approve rules: admins create, edit, disable and delete them on a page
(audited once per change); readers see them; everyone else is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from approvals.models import AutoApproveRule
from approvals.services.rules import (
    auto_approve_rule_create,
    auto_approve_rule_delete,
    auto_approve_rule_update,
)
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import Forbidden, ValidationFailed
from tests.fixtures.console import People, World, client_for, post_form

pytestmark = pytest.mark.django_db

HX = {"HTTP_HX_REQUEST": "true"}
RULE = {
    "kind": "notification-policy",
    "name_prefix": "sandbox-",
    "operations": ["update", "create"],
    "agent": "",
    "description": "sandbox namespace",
    "enabled": "on",
}


def _events(event_type: str) -> int:
    return AuditEvent.objects.filter(event_type=event_type).count()


def test_an_admin_creates_a_rule_and_it_is_audited_once(people: People, world: World) -> None:
    post_form(people.admin, "/rules/new/", RULE, redirects_to="/rules/")
    rule = AutoApproveRule.objects.get()
    assert rule.kind_id == "notification-policy" and rule.name_prefix == "sandbox-"
    assert rule.operations == ["create", "update"] and rule.enabled and rule.agent is None
    assert _events("auto_approve_rule.created") == 1
    html = client_for(people.admin).get("/rules/").content.decode()
    assert "notification-policy/sandbox-*" in html


def test_with_htmx_the_page_fragment_comes_back_with_a_trigger(
    people: People, world: World
) -> None:
    response = client_for(people.admin).post("/rules/new/", {**RULE, "agent": "ops-bot"}, **HX)
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" not in html and 'id="rules-page"' in html and "Rule " in html
    assert "rules-changed" in response["HX-Trigger"]
    assert AutoApproveRule.objects.get().agent == world.agent


def test_bad_input_is_a_422_naming_the_field_and_nothing_is_saved(
    people: People, world: World
) -> None:
    client = client_for(people.admin)
    response = client.post("/rules/new/", {**RULE, "kind": "no-such-kind", "operations": []})
    assert response.status_code == 422
    html = response.content.decode()
    assert "Select a valid choice" in html and "This field is required" in html
    htmx = client.post("/rules/new/", {**RULE, "operations": ["truncate"]}, **HX)
    assert htmx.status_code == 422 and "<html" not in htmx.content.decode()
    assert "HX-Trigger" not in htmx
    assert not AutoApproveRule.objects.exists()
    assert _events("auto_approve_rule.created") == 0


def test_an_admin_edits_a_rule_and_an_unchanged_save_is_not_audited(
    people: People, world: World
) -> None:
    client = client_for(people.admin)
    client.post("/rules/new/", RULE)
    rule = AutoApproveRule.objects.get()
    form = client.get(f"/rules/?edit={rule.pk}").content.decode()
    assert f"Edit rule {rule.pk}" in form and 'value="sandbox-"' in form
    edited = {**RULE, "name_prefix": "sbx-", "operations": ["update"]}
    assert client.post(f"/rules/{rule.pk}/", edited).status_code == 302
    rule.refresh_from_db()
    assert rule.name_prefix == "sbx-" and rule.operations == ["update"]
    again = client.post(f"/rules/{rule.pk}/", edited, **HX)
    assert again.status_code == 200 and "is unchanged" in again.content.decode()
    assert _events("auto_approve_rule.updated") == 1
    event = AuditEvent.objects.get(event_type="auto_approve_rule.updated")
    assert event.details["changed"]["name_prefix"] == {"from": "sandbox-", "to": "sbx-"}


def test_disabling_twice_writes_one_audit_row(people: People, world: World) -> None:
    client = client_for(people.admin)
    client.post("/rules/new/", RULE)
    rule = AutoApproveRule.objects.get()
    first = client.post(f"/rules/{rule.pk}/enabled/", {"enabled": "0"}, **HX)
    assert first.status_code == 200 and "disabled" in first.content.decode()
    second = client.post(f"/rules/{rule.pk}/enabled/", {"enabled": "0"}, **HX)
    assert "was already disabled" in second.content.decode()
    rule.refresh_from_db()
    assert not rule.enabled
    assert _events("auto_approve_rule.updated") == 1
    assert client.post(f"/rules/{rule.pk}/enabled/", {"enabled": "x"}).status_code == 422


def test_deleting_twice_is_a_no_op_the_second_time(people: People, world: World) -> None:
    client = client_for(people.admin)
    client.post("/rules/new/", RULE)
    rule = AutoApproveRule.objects.get()
    assert client.post(f"/rules/{rule.pk}/delete/").status_code == 302
    again = client.post(f"/rules/{rule.pk}/delete/", **HX)
    assert again.status_code == 200 and "already gone" in again.content.decode()
    assert not AutoApproveRule.objects.exists()
    assert _events("auto_approve_rule.deleted") == 1


@pytest.mark.parametrize("who", ["operator", "owner", "auditor", "outsider"])
def test_only_admins_change_rules(people: People, world: World, who: str) -> None:
    rule = AutoApproveRule.objects.create(kind=world.kind, operations=["update"])
    client = client_for(getattr(people, who))
    assert client.post("/rules/new/", RULE).status_code == 403
    assert client.post(f"/rules/{rule.pk}/", RULE).status_code == 403
    assert client.post(f"/rules/{rule.pk}/enabled/", {"enabled": "0"}).status_code == 403
    assert client.post(f"/rules/{rule.pk}/delete/").status_code == 403
    rule.refresh_from_db()
    assert rule.enabled and rule.name_prefix == ""
    assert AutoApproveRule.objects.count() == 1
    assert not AuditEvent.objects.filter(event_type__startswith="auto_approve_rule.").exists()


def test_readers_see_rules_without_edit_controls_and_others_are_refused(
    people: People, world: World
) -> None:
    AutoApproveRule.objects.create(kind=world.kind, name_prefix="sbx-", operations=["update"])
    html = client_for(people.auditor).get("/rules/").content.decode()
    assert "notification-policy/sbx-*" in html and "Only admins add" in html
    assert "Disable" not in html
    assert client_for(people.owner).get("/rules/").status_code == 403
    assert client_for(people.outsider).get("/rules/").status_code == 403


def test_an_unknown_rule_is_a_404(people: People, world: World) -> None:
    client = client_for(people.admin)
    assert client.post("/rules/999999/", RULE).status_code == 404
    assert client.post("/rules/999999/enabled/", {"enabled": "0"}).status_code == 404


def test_the_catalog_and_the_navigation_link_to_the_rules(people: People, world: World) -> None:
    html = client_for(people.admin).get("/catalog/").content.decode()
    assert 'href="/rules/"' in html


def test_the_service_validates_and_checks_the_role(people: People, world: World) -> None:
    with pytest.raises(Forbidden):
        auto_approve_rule_create(
            actor=Actor.person(people.operator), kind="notification-policy", operations=["update"]
        )
    with pytest.raises(ValidationFailed) as caught:
        auto_approve_rule_create(
            actor=Actor.person(people.admin),
            kind="nope",
            operations=["drop"],
            agent="ghost",
            name_prefix="x" * 300,
        )
    fields = {e["field"] for e in caught.value.extra["errors"]}
    assert fields == {"kind", "operations", "agent", "name_prefix"}
    rule = auto_approve_rule_create(
        actor=Actor.person(people.admin),
        kind="notification-policy",
        operations=["delete", "update"],
    )
    assert rule.operations == ["update", "delete"]
    _rule, changed = auto_approve_rule_update(
        actor=Actor.person(people.admin),
        rule_id=rule.pk,
        kind="notification-policy",
        operations=["update", "delete"],
    )
    assert changed is False
    assert auto_approve_rule_delete(actor=Actor.person(people.admin), rule_id=rule.pk) is True
    assert auto_approve_rule_delete(actor=Actor.person(people.admin), rule_id=rule.pk) is False


def test_a_rule_made_on_the_page_admits_a_covered_run(people: People, api: Any, agent: Any) -> None:
    """The rule the page saves is the one run admission reads; disabling it stops that."""
    client = client_for(people.admin)
    rule_form = {**RULE, "kind": "dns-record", "name_prefix": "sandbox-", "agent": "deploy-bot"}
    assert client.post("/rules/new/", rule_form).status_code == 302
    write_set = [{"resource": "dns-record/sandbox-a", "operations": ["update"]}]
    body = {"task": "t", "write_set": write_set}
    first = json.loads(api.post("/api/v1/runs", token=agent.token, body=body).content)
    assert first["status"] == "active"
    rule = AutoApproveRule.objects.get()
    client.post(f"/rules/{rule.pk}/enabled/", {"enabled": "0"})
    # another name: the first run holds sandbox-a
    other = {"task": "t", "write_set": [{**write_set[0], "resource": "dns-record/sandbox-b"}]}
    second = json.loads(api.post("/api/v1/runs", token=agent.token, body=other).content)
    assert second["status"] == "pending_approval"


def test_the_rules_list_is_a_bounded_number_of_queries(
    people: People, world: World, django_assert_max_num_queries: Any
) -> None:
    for n in range(15):
        AutoApproveRule.objects.create(
            kind=world.kind, name_prefix=f"p{n}-", operations=["update"], agent=world.agent
        )
    client = client_for(people.admin)
    with django_assert_max_num_queries(12):
        assert client.get("/rules/").status_code == 200
