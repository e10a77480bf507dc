"""Conflict routing for each seeded class, three-way diff, resolution, undo conflicts."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, Approval, Operation
from approvals.services.execution import action_execute
from approvals.services.undo import action_undo_request, undo_execute
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import Forbidden, InvalidTransition, UndoWindowExpired, ValidationFailed
from ownership.diff import apply_merge_patch, merge_documents, three_way_diff
from ownership.models import Conflict, Resource
from ownership.selectors import conflict_list_for_person
from ownership.services.resolution import conflict_merge_preview, conflict_resolve

pytestmark = pytest.mark.django_db


# -- the diff -------------------------------------------------------------------------


def test_three_way_diff_tells_agent_only_other_only_and_both() -> None:
    base = {"destinations": ["oncall"], "severity": "high", "team": {"name": "sre", "tz": "UTC"}}
    current = {
        "destinations": ["oncall"],
        "severity": "critical",
        "team": {"name": "sre", "tz": "CET"},
    }
    proposed = {
        "destinations": ["oncall", "backup"],
        "severity": "high",
        "team": {"name": "ops", "tz": "EST"},
    }
    rows = {row["path"]: row for row in three_way_diff(base, current, proposed)}
    assert rows["/destinations"]["change"] == "agent_only"
    assert rows["/severity"]["change"] == "other_only"
    assert rows["/team/tz"]["change"] == "both"
    assert rows["/team/name"]["change"] == "agent_only"
    assert rows["/team/tz"]["base"] == "UTC" and rows["/team/tz"]["current"] == "CET"


def test_three_way_diff_reports_added_and_removed_members() -> None:
    rows = {
        r["path"]: r for r in three_way_diff({"a": 1, "b": 2}, {"a": 1}, {"a": 1, "b": 2, "c/d": 3})
    }
    assert rows["/b"]["change"] == "other_only" and rows["/b"]["current_present"] is False
    assert rows["/c~1d"]["change"] == "agent_only" and rows["/c~1d"]["base_present"] is False


def test_merge_takes_chosen_fields_and_defaults_the_rest() -> None:
    base = {"a": 1, "b": 1, "c": 1}
    current = {"a": 2, "b": 1, "c": 2}
    proposed = {"a": 1, "b": 3, "c": 3}
    fields = three_way_diff(base, current, proposed)
    merged = merge_documents(
        current=current, proposed=proposed, fields=fields, choices={"/c": "proposed"}
    )
    # /a other_only -> current, /b agent_only -> proposed, /c both -> chosen
    assert merged == {"a": 2, "b": 3, "c": 3}


def test_merge_patch_follows_rfc_7396() -> None:
    assert apply_merge_patch({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": None}, "d": [1]}) == {
        "a": {"c": 2},
        "d": [1],
    }


# -- routing ----------------------------------------------------------------------------


@pytest.fixture
def world(engine_world: Any, engine_redis: Any) -> Any:
    engine_world.release_owner = engine_world.person("rita", "release-owners")
    engine_world.account_owner = engine_world.person("ali", "account-owners")
    return engine_world


@pytest.mark.parametrize("slug", ["add_unique", "recompute_field"])
def test_agent_classes_return_the_conflict_to_the_agent(world: Any, slug: str) -> None:
    if slug == "add_unique":
        kind = world.kind("dns-record", create="add_unique")
        world.resource(kind, "taken", {"ip": "10.0.0.1"})
        action = world.propose(kind, "taken", operation="create", payload={"ip": "10.0.0.2"})
        assert action_execute(action_id=action.pk) == "conflict"
        action.refresh_from_db()
    else:
        kind = world.kind("report", update="recompute_field")
        action = world.collide(kind, "daily", {"total": 3}, {"total": 5})
    assert action.status == "conflict"
    assert action.error["retryable_by_agent"] is True
    assert action.error["resolver"] == "agent" and action.error["conflict_class"] == slug
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    assert conflict.status == "resolved" and conflict.resolver_group == ""
    # no person is involved
    assert not conflict_list_for_person(world.operator, mine=True, status="open").exists()


@pytest.mark.parametrize(
    ("slug", "group"),
    [
        ("advance_pointer", "release-owners"),
        ("access_change", "account-owners"),
        ("replace_shared_document", "operators"),
    ],
)
def test_person_classes_open_a_conflict_for_their_resolver_group(
    world: Any, slug: str, group: str
) -> None:
    kind = world.kind("thing", update=slug)
    action = world.collide(
        kind,
        "x",
        {"destinations": ["oncall", "backup"], "severity": "high"},
        {"destinations": ["oncall"], "severity": "critical"},
    )
    assert action.error["retryable_by_agent"] is False
    assert action.error.get("lease_covered") is (
        False if slug == "replace_shared_document" else None
    )
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    assert conflict.status == "open" and conflict.resolver_group == group
    assert conflict.base_version == "1" and conflict.current_version == "2"
    changes = {row["path"]: row["change"] for row in conflict.fields}
    assert changes == {"/destinations": "agent_only", "/severity": "other_only"}
    assert AuditEvent.objects.filter(event_type="conflict.opened", action_id=action.pk).count() == 1
    resolver = {
        "release-owners": world.release_owner,
        "account-owners": world.account_owner,
        "operators": world.operator,
    }[group]
    assert list(conflict_list_for_person(resolver, mine=True, status="open")) == [conflict]
    assert not conflict_list_for_person(world.outsider, mine=True).exists()


def test_merge_resolution_creates_a_new_action_on_the_current_version_and_executes_it(
    world: Any,
) -> None:
    kind = world.kind("group", update="access_change")
    action = world.collide(
        kind,
        "admins",
        {"destinations": ["oncall", "backup"], "severity": "low"},
        {"destinations": ["oncall"], "severity": "critical"},
    )
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    assert {r["path"]: r["change"] for r in conflict.fields}["/severity"] == "both"

    with pytest.raises(Forbidden):
        conflict_resolve(
            conflict_id=conflict.pk, actor=Actor.person(world.operator), choice="merge"
        )
    with pytest.raises(ValidationFailed):
        conflict_resolve(
            conflict_id=conflict.pk,
            actor=Actor.person(world.account_owner),
            choice="merge",
            fields={"/nope": "current"},
        )
    choices = {"/severity": "current", "/destinations": "proposed"}
    preview = conflict_merge_preview(conflict=conflict, fields=choices)
    assert preview == {"destinations": ["oncall", "backup"], "severity": "critical"}

    resolved = conflict_resolve(
        conflict_id=conflict.pk,
        actor=Actor.person(world.account_owner),
        choice="merge",
        fields=choices,
        comment="keep critical, add backup",
    )
    assert resolved.status == "resolved" and resolved.resolution == "merge"
    new_action = Action.objects.get(pk=resolved.resolution_action_id)
    assert new_action.parent_id == action.pk and new_action.payload_format == "resolution"
    assert new_action.observed_version == "2" and new_action.status == "queued"
    approval = Approval.objects.get(action=new_action)
    assert approval.status == "approved" and approval.from_conflict_id == conflict.pk
    action.refresh_from_db()
    assert action.error["resolution"]["action"] == str(new_action.pk)
    assert action.error["resolution"]["choice"] == "merge"

    assert action_execute(action_id=new_action.pk) == "applied"
    resource = Resource.objects.get(kind=kind, name="admins")
    assert resource.version == 3 and resource.document == preview
    with pytest.raises(InvalidTransition):
        conflict_resolve(
            conflict_id=conflict.pk, actor=Actor.person(world.account_owner), choice="keep_current"
        )


def test_keep_current_closes_the_conflict_without_writing(world: Any) -> None:
    kind = world.kind("policy", update="replace_shared_document")
    action = world.collide(kind, "p", {"severity": "low"}, {"severity": "critical"})
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    # the agent's owner is an operator, but may not settle their own agent's write
    with pytest.raises(Forbidden) as excinfo:
        conflict_resolve(
            conflict_id=conflict.pk, actor=Actor.person(world.agent_owner), choice="keep_current"
        )
    assert excinfo.value.code == "self_approval"
    conflict_resolve(
        conflict_id=conflict.pk,
        actor=Actor.person(world.operator),
        choice="keep_current",
        comment="ok",
    )
    conflict.refresh_from_db()
    assert conflict.status == "resolved" and conflict.resolution_action_id is None
    assert Resource.objects.get(kind=kind, name="p").version == 2
    action.refresh_from_db()
    assert action.error["resolution"]["choice"] == "keep_current"


def test_take_proposed_writes_the_agents_document_over_the_current_version(world: Any) -> None:
    kind = world.kind("pointer", update="advance_pointer")
    action = world.collide(kind, "release", {"release": "v2"}, {"release": "v3"})
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    resolved = conflict_resolve(
        conflict_id=conflict.pk, actor=Actor.person(world.release_owner), choice="take_proposed"
    )
    assert action_execute(action_id=resolved.resolution_action_id) == "applied"
    assert Resource.objects.get(kind=kind, name="release").document == {"release": "v2"}


def test_a_merge_patch_proposal_is_diffed_as_the_patch_applied_to_the_base(world: Any) -> None:
    kind = world.kind("policy2", update="replace_shared_document")
    action = world.collide(
        kind,
        "p",
        {"destinations": ["oncall", "backup"]},
        {"destinations": ["oncall"], "severity": "critical"},
        payload_format="merge_patch",
    )
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    assert conflict.proposed_document == {"destinations": ["oncall", "backup"], "severity": "high"}


# -- undo ---------------------------------------------------------------------------------


def _applied(world: Any, kind: Any, name: str) -> Action:
    world.resource(kind, name, {"v": 1})
    action = world.propose(kind, name, payload={"v": 2}, observed_version=1)
    assert action_execute(action_id=action.pk) == "applied"
    return action


def test_undo_restores_the_previous_document_once(world: Any) -> None:
    kind = world.kind("cfg", update="recompute_field")
    action = _applied(world, kind, "a")
    first = action_undo_request(
        action_id=action.pk, actor=Actor.run(world.run), idempotency_key="undo-key-1"
    )
    second = action_undo_request(
        action_id=action.pk, actor=Actor.person(world.operator), idempotency_key="undo-key-2"
    )
    assert first.pk == second.pk
    assert AuditEvent.objects.filter(event_type="undo.requested").count() == 1
    assert undo_execute(undo_operation_id=first.pk) == "undone"
    assert undo_execute(undo_operation_id=first.pk) == "skipped"
    action.refresh_from_db()
    assert action.status == "undone"
    resource = Resource.objects.get(kind=kind, name="a")
    assert resource.document == {"v": 1} and resource.version == 3


def test_undo_by_strangers_is_refused(world: Any) -> None:
    kind = world.kind("cfg", update="recompute_field")
    action = _applied(world, kind, "a")
    with pytest.raises(Forbidden):
        action_undo_request(action_id=action.pk, actor=Actor.person(world.outsider))
    from approvals.services.undo import NotFound

    with pytest.raises(NotFound):
        action_undo_request(action_id=action.pk, actor=Actor.run(world.other_run))


def test_undo_after_the_window_is_refused(world: Any) -> None:
    kind = world.kind("cfg", update="recompute_field")
    action = _applied(world, kind, "a")
    Operation.objects.filter(action=action).update(
        undo_deadline=timezone.now() - timedelta(seconds=1)
    )
    with pytest.raises(UndoWindowExpired) as excinfo:
        action_undo_request(action_id=action.pk, actor=Actor.run(world.run))
    assert excinfo.value.code == "undo_window_expired"


def test_undo_after_a_later_write_opens_a_conflict_for_a_person(world: Any) -> None:
    kind = world.kind("cfg", update="recompute_field", owner_group="owners")
    owner = world.person("oscar", "owners")
    action = _applied(world, kind, "a")
    conflict = world.undo_into_conflict(
        action, later_payload={"v": 3}, observed_version=2, requester=owner, key="undo-key-3"
    )
    assert conflict.status == "open" and conflict.resolver_group == "owners"
    assert conflict.current_document == {"v": 3} and conflict.proposed_document == {"v": 1}
    assert Resource.objects.get(kind=kind, name="a").document == {"v": 3}
    # the person who asked for the undo does not settle it
    with pytest.raises(Forbidden):
        conflict_resolve(conflict_id=conflict.pk, actor=Actor.person(owner), choice="take_proposed")
    other_owner = world.person("otto", "owners")
    resolved = conflict_resolve(
        conflict_id=conflict.pk, actor=Actor.person(other_owner), choice="take_proposed"
    )
    assert action_execute(action_id=resolved.resolution_action_id) == "applied"
    assert Resource.objects.get(kind=kind, name="a").document == {"v": 1}
