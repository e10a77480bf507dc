"""Issue 42 §1: approve with edits through the API (PostgreSQL, a real RQ worker where the
write is applied): the edited write applies, the original ends `superseded` with a link to
it, the audit records who edited and the diff, the quorum rule holds, and every refusal
(outside the write set, past the JSON limits, malformed, a resource that moved, a plan's
approval without a `step`) is a clear 4xx that changes nothing. A plan's step edited:
tests/test_plan_edits.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from approvals.models import Action, Approval, ApprovalDecision
from approvals.services.decisions import approval_decide_tallied
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import DomainError, InvalidTransition
from ownership.models import ConflictClass, OwnershipRecord, Resource
from ownership.services.resolution import conflict_resolve
from tests.fixtures.api import (
    make_active_run,
    make_agent_with_token,
    make_person_with_token,
    problem,
)
from tests.fixtures.engine import wait_for
from tests.fixtures.plans import patch_step, plan_status, proposed_plan
from tests.races import Holder, Worker, wait_for_lock_waiters

POLICY = "/api/v1/resources/notification-policy/prod-alerts"


def _propose(api: Any, run: Any, patch: dict[str, Any]) -> dict[str, Any]:
    """The agent's merge patch on prod-alerts read at version 41: pending approval."""
    body = api.accepted_write(
        run.token, "patch", "notification-policy/prod-alerts", patch, if_match='"41"'
    )
    assert body["status"] == "pending_approval"
    return dict(body)


def _approval_of(action_id: str) -> Approval:
    return Approval.objects.get(action_id=action_id)


def _edit(api: Any, person: Any, approval: Approval, **body: Any) -> Any:
    return api.post(
        f"/api/v1/approvals/{approval.pk}/decision",
        token=person.token,
        body={"decision": "approve_with_edits", **body},
    )


def _action(api: Any, token: str, action_id: str) -> dict[str, Any]:
    response = api.get(f"/api/v1/actions/{action_id}", token=token)
    assert response.status_code == 200, response.content
    return dict(response.json())


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_edited_write_applies_and_the_original_is_superseded_with_a_link(
    api: Any, run: Any, operator: Any, prod_alerts: Any, rq_worker: Any
) -> None:
    worker = rq_worker()
    proposed = _propose(api, run, {"channels": ["email", "pager"], "severity": "critical"})
    approval = _approval_of(proposed["id"])

    response = _edit(
        api, operator, approval, patch={"severity": "error"}, comment="critical pages everyone"
    )

    assert response.status_code == 200, response.content
    answer = response.json()
    assert answer["status"] == "approved" and answer["approvals_so_far"] == 1
    edited_id = answer["action"]
    assert edited_id != proposed["id"]
    original = _action(api, run.token, proposed["id"])
    assert original["status"] == "superseded"
    assert original["superseded_by"] == {"id": edited_id, "url": f"/api/v1/actions/{edited_id}"}
    wait_for(lambda: _action(api, run.token, edited_id)["status"] == "applied", timeout=20)
    edited = _action(api, run.token, edited_id)
    assert edited["run"] == str(run.run.pk)
    assert edited["observed_etag"] == '"41"'  # bound to the version the agent observed
    assert edited["execution"]["result_etag"] == '"42"', worker.output()
    assert edited["edited"]["by"] == "ana"
    assert edited["edited"]["supersedes"] == proposed["id"]
    assert edited["edited"]["comment"] == "critical pages everyone"
    assert edited["edited"]["diff"] == [
        {"path": "/severity", "old": '"critical"', "new": '"error"', "kind": "changed"}
    ]
    document = api.get(POLICY, token=run.token).json()["document"]
    assert document["severity"] == "error" and document["channels"] == ["email", "pager"]
    assert Action.objects.get(pk=proposed["id"]).status == "superseded"  # never executed

    # The audit: the decision, the supersession and the edit (author, diff), appended
    # together by the one transaction (consecutive in the chain).
    events = list(
        AuditEvent.objects.filter(
            event_type__in=(
                "approval.decision_approve_with_edits",
                "action.superseded",
                "action.edited",
            )
        ).order_by("seq")
    )
    assert [event.event_type for event in events] == [
        "approval.decision_approve_with_edits",
        "action.superseded",
        "action.edited",
    ]
    assert [event.seq for event in events] == list(range(events[0].seq, events[0].seq + 3))
    assert {event.actor_id for event in events} == {str(operator.user.pk)}
    decision, superseded, edit = events
    assert str(decision.action_id) == proposed["id"]
    assert decision.details["edited_action"] == edited_id
    assert superseded.details["superseded_by"] == edited_id
    assert str(edit.action_id) == edited_id
    assert edit.details["editor"] == "ana" and edit.details["supersedes"] == proposed["id"]
    assert edit.details["diff"] == edited["edited"]["diff"]
    assert Approval.objects.get(pk=approval.pk).status == "cancelled"


@pytest.mark.django_db
def test_a_whole_document_edit_replaces_the_proposal(
    api: Any, run: Any, operator: Any, prod_alerts: Any, engine_redis: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    response = _edit(
        api, operator, _approval_of(proposed["id"]), document={"escalation": {"after_minutes": 5}}
    )
    assert response.status_code == 200, response.content
    edited = Action.objects.get(pk=response.json()["action"])
    assert edited.payload == {"escalation": {"after_minutes": 5}}
    assert edited.payload_format == "merge_patch" and edited.status == "queued"
    assert edited.edited_by == operator.user
    assert edited.edit is not None
    assert {row["kind"] for row in edited.edit["diff"]} == {"added", "removed"}


@pytest.mark.django_db
def test_with_quorum_two_the_edit_is_one_vote_and_another_person_must_approve(
    api: Any, run: Any, operator: Any, prod_alerts: Any, engine_redis: Any
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    second = make_person_with_token("bea", "operators")
    proposed = _propose(api, run, {"severity": "critical"})

    response = _edit(api, operator, _approval_of(proposed["id"]), patch={"severity": "error"})

    assert response.status_code == 200, response.content
    answer = response.json()
    assert answer["status"] == "pending" and answer["approvals_so_far"] == 1
    assert answer["quorum"] == 2
    edited = Action.objects.get(pk=answer["action"])
    assert edited.status == "pending_approval"
    assert Action.objects.get(pk=proposed["id"]).status == "superseded"
    new_approval = Approval.objects.get(pk=answer["id"])
    # The editor counts once: approving their own edit again is refused.
    again = api.post(
        f"/api/v1/approvals/{new_approval.pk}/decision",
        token=operator.token,
        body={"decision": "approve"},
    )
    problem(again, 409, "already_decided")
    edited.refresh_from_db()
    assert edited.status == "pending_approval"

    other = api.post(
        f"/api/v1/approvals/{new_approval.pk}/decision",
        token=second.token,
        body={"decision": "approve"},
    )
    assert other.status_code == 200, other.content
    edited.refresh_from_db()
    assert edited.status == "queued"
    assert set(
        ApprovalDecision.objects.filter(approval=new_approval).values_list(
            "person__username", flat=True
        )
    ) == {"ana", "bea"}


class _Unchanged:
    """What a refused edit must leave as it was: no new action, the original pending,
    its approval pending, no audit event."""

    def __init__(self, proposed: dict[str, Any]) -> None:
        self.proposed = proposed
        self.actions = Action.objects.count()
        self.events = AuditEvent.objects.count()

    def check(self) -> None:
        assert Action.objects.count() == self.actions
        assert Action.objects.get(pk=self.proposed["id"]).status == "pending_approval"
        assert Action.objects.get(pk=self.proposed["id"]).superseded_by_id is None
        assert _approval_of(self.proposed["id"]).status == "pending"
        assert AuditEvent.objects.count() == self.events


@pytest.mark.django_db
def test_an_edit_outside_the_write_set_is_refused_and_changes_nothing(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    # The run's authority over prod-alerts is gone since the agent proposed (as when a
    # lease or record is released): the edited write is checked as the agent's would be.
    OwnershipRecord.objects.filter(run=run.run, name="prod-alerts").update(active=False)
    unchanged = _Unchanged(proposed)

    response = _edit(api, operator, _approval_of(proposed["id"]), patch={"severity": "error"})

    problem(response, 403, "not_in_write_set")
    unchanged.check()


@pytest.mark.django_db
def test_an_edit_of_a_resource_that_moved_is_refused_412_and_changes_nothing(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    Resource.objects.filter(pk=prod_alerts.pk).update(version=42, document={"severity": "info"})
    unchanged = _Unchanged(proposed)

    response = _edit(api, operator, _approval_of(proposed["id"]), patch={"severity": "error"})

    body = problem(response, 412, "stale_version")
    assert body["expected_etag"] == '"41"' and body["current_etag"] == '"42"'
    unchanged.check()


@pytest.mark.django_db
def test_an_edit_of_an_ended_run_is_refused_409(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    type(run.run).objects.filter(pk=run.run.pk).update(status="revoked")
    unchanged = _Unchanged(proposed)
    response = _edit(api, operator, _approval_of(proposed["id"]), patch={"severity": "error"})
    problem(response, 409, "run_not_active")
    unchanged.check()


def _nested(depth: int) -> dict[str, Any]:
    document: dict[str, Any] = {"leaf": 1}
    for _ in range(depth):
        document = {"n": document}
    return document


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        # The API's body parser (jsonsafe) refuses these before the service does.
        pytest.param({"document": _nested(80)}, 422, "deeper than 64", id="deeper-than-jsonsafe"),
        pytest.param(
            {"document": {"k": "x" * 70_000}}, 422, "longer than 65536", id="string-past-limit"
        ),
        pytest.param({"document": [1, 2]}, 422, "valid dictionary", id="not-an-object"),
        pytest.param({}, 422, "document` or a merge `patch", id="neither-document-nor-patch"),
        pytest.param(
            {"document": {"a": 1}, "patch": {"b": 2}}, 422, "not both", id="both-document-and-patch"
        ),
        pytest.param(
            {"patch": {"severity": "critical"}}, 422, "changes nothing", id="changes-nothing"
        ),
    ],
)
def test_a_bad_edit_is_refused_with_a_clear_4xx_and_changes_nothing(
    api: Any,
    run: Any,
    operator: Any,
    prod_alerts: Any,
    body: dict[str, Any],
    status: int,
    detail: str,
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    unchanged = _Unchanged(proposed)
    response = _edit(api, operator, _approval_of(proposed["id"]), **body)
    refused = problem(response, status, "validation_error")
    assert detail in refused["detail"]
    unchanged.check()


@pytest.mark.django_db
def test_malformed_json_and_a_too_large_edit_are_refused(
    api: Any, run: Any, operator: Any, prod_alerts: Any, settings: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    approval = _approval_of(proposed["id"])
    unchanged = _Unchanged(proposed)
    malformed = api.post(
        f"/api/v1/approvals/{approval.pk}/decision",
        token=operator.token,
        raw=b'{"decision": "approve_with_edits", "document": {"severity": ',
    )
    assert malformed.status_code == 400, malformed.content
    assert malformed["Content-Type"] == "application/problem+json"
    # The service's own limit (the console form's path has no HTTP body limit before it).
    settings.AIRLOCK_MAX_BODY_BYTES = 2048
    with pytest.raises(DomainError) as refused:
        approval_decide_tallied(
            approval_id=approval.pk,
            actor=Actor.person(operator.user),
            decision="approve_with_edits",
            edit={"document": {"severity": "x" * 4000}},
        )
    assert refused.value.code == "payload_too_large"
    # And jsonsafe's limits, whoever built the document (the console's form, a patch).
    with pytest.raises(DomainError) as too_deep:
        approval_decide_tallied(
            approval_id=approval.pk,
            actor=Actor.person(operator.user),
            decision="approve_with_edits",
            edit={"patch": {"nested": _nested(80)}},
        )
    assert too_deep.value.code == "validation_error" and "deeper than 64" in too_deep.value.message
    unchanged.check()


@pytest.mark.django_db
def test_document_or_patch_with_a_plain_decision_is_refused(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    unchanged = _Unchanged(proposed)
    response = api.post(
        f"/api/v1/approvals/{_approval_of(proposed['id']).pk}/decision",
        token=operator.token,
        body={"decision": "approve", "document": {"severity": "error"}},
    )
    problem(response, 422, "validation_error")
    unchanged.check()


@pytest.mark.django_db
def test_a_run_approval_cannot_be_approved_with_edits(api: Any, agent: Any, operator: Any) -> None:
    created = api.create_run(
        agent.token, [{"resource": "dns-record/app-web", "operations": ["update"]}]
    )
    assert created.status_code == 201, created.content
    approval = Approval.objects.get(run_id=created.json()["id"], subject="run")
    response = _edit(api, operator, approval, document={"a": 1})
    body = problem(response, 422, "validation_error")
    assert "single write" in body["detail"]
    assert Approval.objects.get(pk=approval.pk).status == "pending"


@pytest.mark.django_db
def test_the_agent_cannot_edit_and_separation_of_duties_holds(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    outsider = make_person_with_token("otto")
    unchanged = _Unchanged(proposed)
    response = _edit(api, outsider, _approval_of(proposed["id"]), patch={"severity": "error"})
    problem(response, 403, "forbidden")
    unchanged.check()
    assert json.loads(response.content)["code"] == "forbidden"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["approve", "edit"])
def test_an_edit_racing_a_plain_approval_leaves_exactly_one_decision(
    api: Any, run: Any, operator: Any, prod_alerts: Any, first: str
) -> None:
    """Both deciders are in and wait on the approval row (held); whichever takes it first
    decides, the other is refused 409 already_decided: never an approved original AND an
    edited write."""
    second = make_person_with_token("bea", "operators")
    proposed = _propose(api, run, {"severity": "critical"})
    approval = _approval_of(proposed["id"])

    def approve() -> Any:
        return approval_decide_tallied(
            approval_id=approval.pk, actor=Actor.person(second.user), decision="approve"
        )

    def edit() -> Any:
        return approval_decide_tallied(
            approval_id=approval.pk,
            actor=Actor.person(operator.user),
            decision="approve_with_edits",
            edit={"patch": {"severity": "error"}},
        )

    blocker = Holder(lambda: list(Approval.objects.select_for_update().filter(pk=approval.pk)))
    blocker.hold()
    order = (approve, edit) if first == "approve" else (edit, approve)
    deciders = [Worker(order[0])]
    deciders[0].start()
    wait_for_lock_waiters(1, threads=tuple(deciders))
    deciders.append(Worker(order[1]))
    deciders[1].start()
    wait_for_lock_waiters(2, threads=tuple(deciders))
    blocker.release()
    outcomes: list[str] = []
    for decider in deciders:
        try:
            decider.finish()
            outcomes.append("ok")
        except InvalidTransition as exc:
            outcomes.append(exc.code)
    assert sorted(outcomes) == ["already_decided", "ok"]
    original = Action.objects.get(pk=proposed["id"])
    edited = Action.objects.filter(edited_by__isnull=False)
    if first == "approve":
        assert original.status == "queued" and not edited.exists()
        assert Approval.objects.get(pk=approval.pk).status == "approved"
    else:
        assert original.status == "superseded" and edited.count() == 1
        assert Approval.objects.get(pk=approval.pk).status == "cancelled"
        assert not ApprovalDecision.objects.filter(approval=approval).exists()


@pytest.mark.django_db(transaction=True)
def test_an_edit_waiting_on_a_revoke_sees_the_run_ended_and_changes_nothing(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    approval = _approval_of(proposed["id"])
    # A revoke holds the run row FOR UPDATE and commits the run's end.
    blocker = Holder(lambda: type(run.run).objects.filter(pk=run.run.pk).update(status="revoked"))
    blocker.hold()
    editor = Worker(
        lambda: approval_decide_tallied(
            approval_id=approval.pk,
            actor=Actor.person(operator.user),
            decision="approve_with_edits",
            edit={"patch": {"severity": "error"}},
        )
    )
    editor.start()
    wait_for_lock_waiters(1, threads=(editor,))
    blocker.release()
    with pytest.raises(DomainError) as refused:
        editor.finish()
    assert refused.value.code == "run_not_active"
    assert Action.objects.get(pk=proposed["id"]).status == "pending_approval"
    assert not Action.objects.filter(edited_by__isnull=False).exists()


@pytest.mark.django_db
def test_a_plan_approval_edited_without_a_step_is_refused_422_and_stays_pending(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    # A plan's step is edited by naming it (tests/test_plan_edits.py); without `step` the
    # edit cannot say which of the plan's writes it replaces.
    plan_id = proposed_plan(
        api, run, [patch_step("notification-policy/prod-alerts", '"41"', {"severity": "error"})]
    )
    approval = Approval.objects.get(plan_id=plan_id)
    events = AuditEvent.objects.count()
    response = _edit(api, operator, approval, document={"severity": "info"})
    body = problem(response, 422, "validation_error")
    assert "name the `step`" in body["detail"]
    assert body["errors"][0]["field"] == "step"
    assert Approval.objects.get(pk=approval.pk).status == "pending"
    assert plan_status(plan_id) == "pending_approval"
    assert AuditEvent.objects.count() == events


@pytest.mark.django_db
def test_the_agents_owner_may_not_edit_where_the_class_forbids_it(
    api: Any, prod_alerts: Any
) -> None:
    owner = make_person_with_token("olga", "operators")
    agent = make_agent_with_token("owned-bot", owner=owner.user)
    run = make_active_run(agent.agent)
    proposed = _propose(api, run, {"severity": "critical"})
    unchanged = _Unchanged(proposed)
    response = _edit(api, owner, _approval_of(proposed["id"]), patch={"severity": "error"})
    problem(response, 403, "self_approval")
    unchanged.check()


@pytest.mark.django_db
def test_a_conflict_resolution_awaiting_votes_cannot_be_edited(
    engine_world: Any, engine_redis: Any
) -> None:
    kind = engine_world.kind("shared-doc", update="replace_shared_document")
    stale = engine_world.collide(
        kind, "x", {"destinations": ["oncall", "backup"]}, {"destinations": ["oncall"]}
    )
    # A resolution of a quorum-2 class waits for another person's vote.
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    conflict_resolve(
        conflict_id=stale.error["conflict_id"],
        actor=Actor.person(engine_world.operator),
        choice="take_proposed",
    )
    resolution = Action.objects.get(parent=stale)
    assert resolution.status == "pending_approval"
    approval = Approval.objects.get(action=resolution, status="pending")
    with pytest.raises(DomainError) as refused:
        approval_decide_tallied(
            approval_id=approval.pk,
            actor=Actor.person(engine_world.operator2),
            decision="approve_with_edits",
            edit={"patch": {"destinations": ["backup"]}},
        )
    assert refused.value.code == "validation_error" and "resolution" in refused.value.message
    resolution.refresh_from_db()
    assert resolution.status == "pending_approval" and resolution.superseded_by_id is None


@pytest.mark.django_db
def test_who_may_decide_is_answered_before_anything_about_the_run_or_resource(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    proposed = _propose(api, run, {"severity": "critical"})
    type(run.run).objects.filter(pk=run.run.pk).update(status="revoked")
    Resource.objects.filter(pk=prod_alerts.pk).update(version=42)
    outsider = make_person_with_token("otto")
    response = _edit(api, outsider, _approval_of(proposed["id"]), patch={"severity": "error"})
    body = problem(response, 403, "forbidden")
    assert "current_etag" not in body and "run_status" not in body


@pytest.mark.django_db
def test_an_edited_write_awaiting_a_second_person_can_be_edited_again(
    api: Any, run: Any, operator: Any, prod_alerts: Any, engine_redis: Any
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    second = make_person_with_token("bea", "operators")
    proposed = _propose(api, run, {"severity": "critical"})
    first = _edit(api, operator, _approval_of(proposed["id"]), patch={"severity": "error"})
    assert first.status_code == 200, first.content
    again = _edit(api, second, _approval_of(first.json()["action"]), patch={"severity": "info"})
    assert again.status_code == 200, again.content
    assert again.json()["status"] == "pending" and again.json()["approvals_so_far"] == 1
    chain = [proposed["id"], first.json()["action"], again.json()["action"]]
    rows = {str(a.pk): a for a in Action.objects.filter(pk__in=chain)}
    assert [rows[c].status for c in chain] == ["superseded", "superseded", "pending_approval"]
    assert str(rows[chain[0]].superseded_by_id) == chain[1]
    assert str(rows[chain[1]].superseded_by_id) == chain[2]
    assert rows[chain[2]].payload == {"severity": "info"}
    last_edit = rows[chain[2]].edit
    assert last_edit is not None and last_edit["by"] == "bea"
