"""Issue 42 §1, a plan's step approved with edits through the API (PostgreSQL, a real RQ
worker where the edited plan executes): the edited plan is a new plan in the same run
and applies with the edited step's document; the original ends `superseded` with a link
to it; the audit records who edited which step and the diff; with a quorum of two
another person must approve; every refusal (an unknown or delete step, no `step`, a
step leaving the write set, a broken limit, a version that moved, a malformed body) is a
clear 4xx that changes nothing.

The run's write set covers notification-policy/prod-alerts (update: per-call
replace_shared_document, so the plan waits for one approval) and dns-record/app-*
(per-run classes)."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Action, Approval, ApprovalDecision, Plan, PlanStep
from approvals.services.decisions import approval_decide_tallied
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import DomainError
from ownership.models import ConflictClass, OwnershipRecord
from tests.fixtures.api import (
    make_active_run,
    make_agent_with_token,
    make_person_with_token,
    problem,
)
from tests.fixtures.console import client_for
from tests.fixtures.engine import wait_for
from tests.fixtures.plans import (
    POLICY,
    bump_resource,
    plan_status,
    policy_then_app_a,
    proposed_plan,
    put_step,
    read_plan,
    resource_row,
)

pytestmark = pytest.mark.usefixtures("plan_world")


def _approval_of(plan_id: str) -> Approval:
    return Approval.objects.get(plan_id=plan_id)


def _edit(api: Any, person: Any, approval: Approval, **body: Any) -> Any:
    return api.post(
        f"/api/v1/approvals/{approval.pk}/decision",
        token=person.token,
        body={"decision": "approve_with_edits", **body},
    )


class _Unchanged:
    """What a refused edit must leave as it was: no new plan, the original pending with
    its steps as proposed, its approval pending without votes, no audit event."""

    def __init__(self, plan_id: str) -> None:
        self.plan_id = plan_id
        self.plans = Plan.objects.count()
        self.events = AuditEvent.objects.count()
        self.steps = list(
            PlanStep.objects.filter(plan_id=plan_id)
            .order_by("position")
            .values_list("payload", "status", "observed_version")
        )

    def check(self) -> None:
        assert Plan.objects.count() == self.plans
        original = Plan.objects.get(pk=self.plan_id)
        assert original.status == "pending_approval" and original.superseded_by_id is None
        steps = list(
            PlanStep.objects.filter(plan_id=self.plan_id)
            .order_by("position")
            .values_list("payload", "status", "observed_version")
        )
        assert steps == self.steps
        approval = _approval_of(self.plan_id)
        assert approval.status == "pending"
        assert not ApprovalDecision.objects.filter(approval=approval).exists()
        assert AuditEvent.objects.count() == self.events


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_edited_plan_applies_with_the_edited_step_and_the_original_is_superseded(
    api: Any, run: Any, operator: Any, rq_worker: Any
) -> None:
    worker = rq_worker()
    plan_id = proposed_plan(api, run, policy_then_app_a())
    approval = _approval_of(plan_id)

    response = _edit(
        api,
        operator,
        approval,
        step=1,
        patch={"channels": ["pager", "sms"]},
        comment="pages and texts",
    )

    assert response.status_code == 200, response.content
    answer = response.json()
    assert answer["subject"] == "plan" and answer["status"] == "approved"
    assert answer["approvals_so_far"] == 1
    edited_id = answer["plan"]
    assert edited_id != plan_id
    original = read_plan(api, run.token, plan_id)
    assert original["status"] == "superseded"
    assert original["superseded_by"] == {"id": edited_id, "url": f"/api/v1/plans/{edited_id}"}
    assert original["approval"]["status"] == "cancelled"
    assert [s["status"] for s in original["steps"]] == ["skipped", "skipped"]

    wait_for(lambda: plan_status(edited_id) == "applied", timeout=30)
    edited = read_plan(api, run.token, edited_id)
    assert [s["status"] for s in edited["steps"]] == ["applied", "applied"], worker.output()
    assert edited["run"] == str(run.run.pk)
    # Every step bound to the version the agent observed; only step 1's patch changed.
    assert [s["observed_etag"] for s in edited["steps"]] == ['"41"', '"3"']
    assert edited["steps"][0]["patch"] == {"channels": ["pager", "sms"]}
    assert edited["steps"][1]["patch"] == {"ip": "2"}
    # Arrays are leaves of ownership.diff's document_diff: the agent's step -> the approved.
    assert edited["edited"] == {
        "by": "ana",
        "supersedes": plan_id,
        "step": 1,
        "resource": POLICY,
        "comment": "pages and texts",
        "diff": [
            {
                "path": "/channels",
                "old": '["pager"]',
                "new": '["pager", "sms"]',
                "kind": "changed",
            }
        ],
    }
    assert resource_row(POLICY).document == {"channels": ["pager", "sms"]}
    assert resource_row("dns-record/app-a").document == {"ip": "2"}
    # Nothing of the original ran: its steps never got an action.
    assert not PlanStep.objects.filter(plan_id=plan_id, action__isnull=False).exists()
    assert Plan.objects.get(pk=edited_id).edited_by == operator.user

    events = list(
        AuditEvent.objects.filter(
            event_type__in=(
                "approval.decision_approve_with_edits",
                "plan.superseded",
                "plan.edited",
                "approval.approved",
            ),
            run_id=run.run.pk,
        ).order_by("seq")
    )
    assert [event.event_type for event in events] == [
        "approval.decision_approve_with_edits",
        "plan.superseded",
        "plan.edited",
        "approval.approved",
    ]
    # Appended together by the one transaction.
    assert [event.seq for event in events] == list(range(events[0].seq, events[0].seq + 4))
    assert {event.actor_id for event in events} == {str(operator.user.pk)}
    decision, superseded, edit, approved = events
    assert decision.details["plan"] == plan_id and decision.details["step"] == 1
    assert decision.details["edited_plan"] == edited_id
    assert decision.details["comment"] == "pages and texts"
    assert superseded.details == {
        "plan": plan_id,
        "superseded_by": edited_id,
        "approval": str(approval.pk),
    }
    assert edit.details["plan"] == edited_id and edit.details["supersedes"] == plan_id
    assert edit.details["editor"] == "ana" and edit.details["step"] == 1
    assert edit.details["diff"] == edited["edited"]["diff"] != []
    assert approved.details["plan"] == edited_id and approved.details["queued"] is True
    # The agent's proposal stays on the trail as it was.
    assert AuditEvent.objects.filter(event_type="plan.proposed", details__plan=plan_id).exists()


@pytest.mark.django_db
def test_a_whole_document_edit_of_a_put_step_replaces_its_document(
    api: Any, run: Any, operator: Any, engine_redis: Any
) -> None:
    plan_id = proposed_plan(
        api,
        run,
        [
            put_step(POLICY, '"41"', {"channels": ["pager"]}),
            put_step("dns-record/app-a", '"3"', {"ip": "2"}),
        ],
    )
    response = _edit(api, operator, _approval_of(plan_id), step=2, document={"ip": "3", "ttl": 60})
    assert response.status_code == 200, response.content
    edited = Plan.objects.get(pk=response.json()["plan"])
    assert edited.status == "executing"  # approved: handed to the engine
    steps = list(edited.steps.order_by("position"))
    assert steps[0].payload == {"channels": ["pager"]} and steps[0].payload_format == "replace"
    assert steps[1].payload == {"ip": "3", "ttl": 60} and steps[1].payload_format == "replace"
    assert [s.observed_version for s in steps] == ["41", "3"]
    assert edited.edit is not None and edited.edit["step"] == 2
    assert edited.edit["resource"] == "dns-record/app-a"
    assert {row["kind"] for row in edited.edit["diff"]} == {"changed", "added"}


@pytest.mark.django_db
def test_with_quorum_two_the_edit_is_one_vote_and_another_person_must_approve(
    api: Any, run: Any, operator: Any, engine_redis: Any
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    second = make_person_with_token("bea", "operators")
    plan_id = proposed_plan(api, run, policy_then_app_a())

    response = _edit(api, operator, _approval_of(plan_id), step=2, patch={"ip": "7"})

    assert response.status_code == 200, response.content
    answer = response.json()
    assert answer["status"] == "pending" and answer["approvals_so_far"] == 1
    assert answer["quorum"] == 2
    edited_id = answer["plan"]
    assert plan_status(edited_id) == "pending_approval"
    assert plan_status(plan_id) == "superseded"
    new_approval = Approval.objects.get(pk=answer["id"])
    assert new_approval.plan_id is not None and str(new_approval.plan_id) == edited_id
    # The editor counts once: approving their own edit again is refused.
    again = api.decide(str(new_approval.pk), "approve", token=operator.token)
    problem(again, 409, "already_decided")
    assert plan_status(edited_id) == "pending_approval"

    other = api.decide(str(new_approval.pk), "approve", token=second.token)
    assert other.status_code == 200, other.content
    assert other.json()["status"] == "approved"
    assert plan_status(edited_id) == "executing"
    assert set(
        ApprovalDecision.objects.filter(approval=new_approval).values_list(
            "person__username", flat=True
        )
    ) == {"ana", "bea"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        pytest.param({"step": 3, "patch": {"ip": "7"}}, 422, "no step 3", id="unknown-step"),
        pytest.param({"patch": {"ip": "7"}}, 422, "name the `step`", id="no-step"),
        pytest.param({"step": 2}, 422, "document` or a merge `patch", id="no-document"),
        pytest.param(
            {"step": 2, "document": {"a": 1}, "patch": {"b": 2}}, 422, "not both", id="both"
        ),
        pytest.param({"step": 2, "patch": {"ip": "2"}}, 422, "changes nothing", id="no-change"),
        pytest.param({"step": 0, "patch": {"ip": "7"}}, 422, "", id="step-zero"),
        pytest.param({"step": "2", "patch": {"ip": "7"}}, 422, "", id="step-not-an-integer"),
        pytest.param({"step": 2, "document": [1]}, 422, "", id="document-not-an-object"),
    ],
)
def test_a_bad_plan_edit_is_refused_with_a_clear_4xx_and_changes_nothing(
    api: Any, run: Any, operator: Any, body: dict[str, Any], status: int, detail: str
) -> None:
    plan_id = proposed_plan(api, run, policy_then_app_a())
    unchanged = _Unchanged(plan_id)
    response = _edit(api, operator, _approval_of(plan_id), **body)
    refused = problem(response, status, "validation_error")
    assert detail in refused["detail"]
    unchanged.check()


@pytest.mark.django_db
def test_a_delete_step_cannot_be_edited(api: Any, run: Any, operator: Any) -> None:
    plan_id = proposed_plan(
        api,
        run,
        [
            {"resource": POLICY, "method": "PATCH", "if_match": '"41"', "patch": {"a": 1}},
            {"resource": "dns-record/app-a", "method": "DELETE", "if_match": '"3"'},
        ],
    )
    unchanged = _Unchanged(plan_id)
    response = _edit(api, operator, _approval_of(plan_id), step=2, document={"ip": "9"})
    refused = problem(response, 422, "validation_error")
    assert "delete" in refused["detail"]
    assert refused["errors"][0]["field"] == "step"
    unchanged.check()


@pytest.mark.django_db
def test_a_step_the_run_may_no_longer_write_is_refused_403_naming_it(
    api: Any, run: Any, operator: Any
) -> None:
    plan_id = proposed_plan(api, run, policy_then_app_a())
    # The run's authority over app-a is gone since the agent proposed: every step of the
    # edited plan is checked again, not only the one edited.
    OwnershipRecord.objects.filter(run=run.run, kind_id="dns-record").update(active=False)
    unchanged = _Unchanged(plan_id)
    response = _edit(api, operator, _approval_of(plan_id), step=1, patch={"channels": ["sms"]})
    refused = problem(response, 403, "not_in_write_set")
    assert refused["step"] == 2
    unchanged.check()


@pytest.mark.django_db
def test_a_step_whose_resource_moved_is_refused_412_naming_it(
    api: Any, run: Any, operator: Any
) -> None:
    plan_id = proposed_plan(api, run, policy_then_app_a())
    bump_resource(POLICY, {"channels": ["email", "fax"]})
    unchanged = _Unchanged(plan_id)
    response = _edit(api, operator, _approval_of(plan_id), step=2, patch={"ip": "7"})
    refused = problem(response, 412, "stale_version")
    assert refused["step"] == 1
    assert refused["expected_etag"] == '"41"' and refused["current_etag"] == '"42"'
    unchanged.check()


@pytest.mark.django_db
def test_a_broken_limit_is_refused_and_changes_nothing(
    api: Any, run: Any, operator: Any, settings: Any
) -> None:
    plan_id = proposed_plan(api, run, policy_then_app_a())
    approval = _approval_of(plan_id)
    unchanged = _Unchanged(plan_id)
    # The plan's own limit, checked again on the edited plan as on a proposal.
    limit = settings.AIRLOCK_PLAN_MAX_STEPS
    settings.AIRLOCK_PLAN_MAX_STEPS = 1
    too_many = _edit(api, operator, approval, step=2, patch={"ip": "7"})
    assert "at most 1 steps" in problem(too_many, 422, "validation_error")["detail"]
    settings.AIRLOCK_PLAN_MAX_STEPS = limit
    # An API body's size limit, on the edited step's write.
    settings.AIRLOCK_MAX_BODY_BYTES = 2048
    with pytest.raises(DomainError) as too_large:
        approval_decide_tallied(
            approval_id=approval.pk,
            actor=Actor.person(operator.user),
            decision="approve_with_edits",
            edit={"step": 2, "document": {"ip": "x" * 4000}},
        )
    assert too_large.value.code == "payload_too_large"
    malformed = api.post(
        f"/api/v1/approvals/{approval.pk}/decision",
        token=operator.token,
        raw=b'{"decision": "approve_with_edits", "step": 2, "patch": {"ip": ',
    )
    assert malformed.status_code == 400, malformed.content
    assert malformed["Content-Type"] == "application/problem+json"
    unchanged.check()


@pytest.mark.django_db
def test_a_step_with_a_plain_decision_is_refused(api: Any, run: Any, operator: Any) -> None:
    plan_id = proposed_plan(api, run, policy_then_app_a())
    unchanged = _Unchanged(plan_id)
    plain = api.post(
        f"/api/v1/approvals/{_approval_of(plan_id).pk}/decision",
        token=operator.token,
        body={"decision": "approve", "step": 1},
    )
    assert "`step`" in problem(plain, 422, "validation_error")["detail"]
    unchanged.check()


@pytest.mark.django_db
def test_a_step_on_a_single_writes_approval_is_refused(api: Any, run: Any, operator: Any) -> None:
    body = api.accepted_write(run.token, "patch", POLICY, {"channels": ["pager"]}, if_match='"41"')
    approval = Approval.objects.get(action_id=body["id"])
    events = AuditEvent.objects.count()
    response = _edit(api, operator, approval, step=1, patch={"channels": ["sms"]})
    refused = problem(response, 422, "validation_error")
    assert refused["errors"][0]["field"] == "step"
    assert Action.objects.get(pk=body["id"]).status == "pending_approval"
    assert Approval.objects.get(pk=approval.pk).status == "pending"
    assert AuditEvent.objects.count() == events


@pytest.mark.django_db
def test_the_agents_owner_may_not_edit_where_a_step_class_forbids_it(
    api: Any, operator: Any
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(
        forbid_agent_owner_approval=True
    )
    owner = make_person_with_token("olga", "operators")
    agent = make_agent_with_token("owned-bot", owner=owner.user)
    run = make_active_run(agent.agent)
    plan_id = proposed_plan(api, run, policy_then_app_a())
    unchanged = _Unchanged(plan_id)
    response = _edit(api, owner, _approval_of(plan_id), step=2, patch={"ip": "7"})
    problem(response, 403, "self_approval")
    unchanged.check()
    # The agent's own token cannot decide at all.
    refused = _edit(api, run, _approval_of(plan_id), step=2, patch={"ip": "7"})
    assert refused.status_code in (401, 403), refused.content
    unchanged.check()
    assert not Action.objects.filter(run=run.run).exists()


# --- The console: the plan card's form per step -------------------------------------


@pytest.mark.django_db
def test_the_plan_card_offers_a_form_per_step_and_an_htmx_edit_supersedes_the_plan(
    api: Any, run: Any, operator: Any
) -> None:
    plan_id = proposed_plan(api, run, policy_then_app_a())
    approval = _approval_of(plan_id)
    client = client_for(operator.user)
    html = client.get("/approvals/").content.decode()
    url = f"/approvals/{approval.pk}/edit/"
    assert html.count(f'hx-post="{url}"') == 2  # one form per step with a document
    assert '<input type="hidden" name="step" value="2">' in html
    assert "&quot;ip&quot;: &quot;2&quot;" in html  # step 2's patch, prefilled

    response = client.post(
        url,
        {"step": "2", "document": '{"ip": "7"}', "comment": "the other address"},
        HTTP_HX_REQUEST="true",
    )

    assert response.status_code == 200, response.content
    assert f'id="approval-{approval.pk}"' in response.content.decode()
    original = Plan.objects.get(pk=plan_id)
    edited = original.superseded_by
    assert original.status == "superseded" and edited is not None
    assert edited.edited_by == operator.user and edited.status == "executing"
    assert edited.edit is not None and edited.edit["comment"] == "the other address"
    assert edited.steps.get(position=2).payload == {"ip": "7"}
    page = client.get(f"/plans/{plan_id}/").content.decode()
    assert 'id="plan-superseded-by"' in page and str(edited.pk) in page
    assert 'id="plan-edited"' in client.get(f"/plans/{edited.pk}/").content.decode()


@pytest.mark.django_db
def test_a_refused_step_edit_from_the_card_is_shown_and_changes_nothing(
    api: Any, run: Any, operator: Any
) -> None:
    plan_id = proposed_plan(api, run, policy_then_app_a())
    approval = _approval_of(plan_id)
    unchanged = _Unchanged(plan_id)
    response = client_for(operator.user).post(
        f"/approvals/{approval.pk}/edit/",
        {"step": "9", "document": '{"ip": "7"}', "comment": ""},
        HTTP_HX_REQUEST="true",
    )
    assert response.status_code == 422, response.content
    assert "no step 9" in response.content.decode()
    unchanged.check()
