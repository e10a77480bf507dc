"""Issue 38 §1-2: a plan's compensation is a write like any other, and it never erases a
change it did not make. Real PostgreSQL, a private Redis and `rqworker` processes; the
resources and write set as in tests/test_plans.py (dns-record/app-*: create add_unique,
update and delete recompute_field, all per-run; the policy: replace_shared_document,
per-call, resolved by `operators`)."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Operation, PlanStep
from approvals.services.actions import action_cancel
from approvals.services.plan_engine import plan_advance
from audit.models import AuditEvent
from audit.services import Actor
from console.services import kill_switch_set
from ownership.models import Conflict, ResourceKind
from tests.fixtures import plans as plan_fx
from tests.fixtures.api import make_active_run
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SYSTEM = Actor.system("test")


def _hold(identifier: str) -> None:
    kill_switch_set(scope=identifier, engaged=True, reason="hold the step", actor=SYSTEM)


def _paused(plan_id: str, position: int) -> bool:
    action = plan_fx.step_action(plan_id, position)
    return action is not None and action.status == "paused"


def _agent_cancels_step(run: Any, plan_id: str, position: int) -> None:
    """The agent cancels its own paused step (what forces the compensation)."""
    action = plan_fx.step_action(plan_id, position)
    assert action is not None
    action_cancel(action=action, actor=Actor.run(run.run))
    plan_advance(plan_id=plan_id)  # the reconciler's move, without waiting for its tick


def _take_proposed(api: Any, person: Any, conflict_id: str) -> None:
    resolved = api.post(
        f"/api/v1/conflicts/{conflict_id}/resolution",
        token=person.token,
        body={"choice": "take_proposed", "comment": "as proposed"},
    )
    assert resolved.status_code == 200, resolved.content


def _app_a_with_compensation(compensation: dict[str, Any]) -> list[dict[str, Any]]:
    step = plan_fx.patch_step("dns-record/app-a", '"3"', {"ip": "2"})
    return [{**step, "compensation": compensation}, plan_fx.create_step("dns-record/app-b", {})]


# --- §1: checked at creation as the write it is ---------------------------------------


def test_a_delete_compensation_outside_the_write_set_is_refused_and_deletes_nothing(
    api: Any, agent: Any, plan_world: Any, rq_worker: Any
) -> None:
    """The run may update and create dns records, never delete one. Today the plan
    with {"method": "DELETE"} as step 1's compensation was accepted and cancelling its
    own step 2 deleted app-a; now the plan is refused (403, naming the step and its
    compensation) and nothing is recorded."""
    run = make_active_run(
        agent.agent, [{"resource": "dns-record/app-*", "operations": ["create", "update"]}]
    )
    rq_worker()
    _hold("dns-record/app-b")
    response = plan_fx.propose_plan(api, run, _app_a_with_compensation({"method": "DELETE"}))
    if response.status_code == 202:  # today's behaviour: play the attack to its end
        plan_id = response.json()["id"]
        wait_for(lambda: _paused(plan_id, 2), timeout=30)
        _agent_cancels_step(run, plan_id, 2)
        wait_for(lambda: plan_fx.plan_status(plan_id) == "compensated", timeout=30)
    assert not plan_fx.resource_row("dns-record/app-a").deleted
    assert response.status_code == 403, response.content
    problem = response.json()
    assert response["Content-Type"].startswith("application/problem+json")
    assert problem["code"] == "not_in_write_set"
    assert problem["step"] == 1 and problem["field"] == "compensation"
    assert problem["operation"] == "delete"
    assert PlanStep.objects.count() == 0


@pytest.mark.parametrize(
    ("compensation", "field"),
    [
        ({"method": "PATCH", "patch": {"ip": "1"}}, "steps[0].compensation.method"),
        ({"method": "DELETE"}, "steps[0].compensation.method"),
    ],
    ids=["patch-after-delete", "delete-after-delete"],
)
def test_a_compensation_that_cannot_apply_after_its_step_is_a_422(
    api: Any, run: Any, plan_world: Any, compensation: dict[str, Any], field: str
) -> None:
    step = {"resource": "dns-record/app-a", "method": "DELETE", "if_match": '"3"'}
    response = plan_fx.propose_plan(api, run, [{**step, "compensation": compensation}])
    assert response.status_code == 422, response.content
    assert response.json()["errors"][0]["field"] == field
    assert PlanStep.objects.count() == 0


def test_a_compensation_past_the_json_limits_is_a_422_and_records_nothing(
    api: Any, run: Any, plan_world: Any
) -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(80):
        node["a"] = {}
        node = node["a"]
    response = plan_fx.propose_plan(
        api, run, _app_a_with_compensation({"method": "PUT", "document": deep})
    )
    assert response.status_code == 422, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    assert PlanStep.objects.count() == 0


def test_a_per_call_delete_compensation_makes_a_per_run_plan_wait_for_its_approval(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    """Every step per-run, but deleting a dns record is per-call: the plan may not
    start at once (today it did, and cancelling step 2 deleted app-a with nobody
    approving). The approver sees the compensation as a diff against the version the
    agent observed, in the API and on the approval card."""
    ResourceKind.objects.filter(slug="dns-record").update(class_delete="replace_shared_document")
    rq_worker()
    _hold("dns-record/app-b")
    response = plan_fx.propose_plan(api, run, _app_a_with_compensation({"method": "DELETE"}))
    assert response.status_code == 202, response.content
    plan_id = response.json()["id"]
    wait_for(lambda: plan_fx.plan_status(plan_id) != "executing" or _paused(plan_id, 2), timeout=30)
    if _paused(plan_id, 2):  # today's behaviour: the agent forces the compensation
        _agent_cancels_step(run, plan_id, 2)
        wait_for(
            lambda: plan_fx.plan_status(plan_id) not in ("executing", "compensating"), timeout=30
        )
    assert not plan_fx.resource_row("dns-record/app-a").deleted
    assert plan_fx.plan_status(plan_id) == "pending_approval"

    body = plan_fx.read_plan(api, operator.token, plan_id)
    step = body["steps"][0]
    assert step["patch"] == {"ip": "2"}
    assert step["diff"] == [{"path": "/ip", "old": '"1"', "new": '"2"', "kind": "changed"}]
    compensation = step["compensation"]
    assert compensation["method"] == "DELETE" and compensation["operation"] == "delete"
    assert compensation["conflict_class"] == "replace_shared_document"
    assert compensation["deletes"] is True
    assert compensation["diff"] == [{"path": "/ip", "old": '"1"', "new": None, "kind": "removed"}]
    assert body["steps"][1]["compensation"]["method"] == "undo"
    assert body["steps"][1]["compensation"]["diff"] == []

    listing = api.get("/api/v1/approvals?status=pending", token=operator.token)
    [item] = [i for i in listing.json()["items"] if i.get("plan") == plan_id]
    assert item["steps"][0]["patch"] == {"ip": "2"}
    assert item["steps"][0]["observed_diff"] == step["diff"]
    written = item["steps"][0]["compensation_write"]
    assert written["method"] == "DELETE" and written["deletes"] is True
    assert written["conflict_class"] == "replace_shared_document"
    assert written["diff"] == compensation["diff"]

    from django.test import Client

    client = Client()
    client.force_login(operator.user)
    inbox = client.get("/approvals/")
    assert inbox.status_code == 200
    card = inbox.content.decode()
    assert 'data-compensation-method="DELETE"' in card
    assert "the resource <strong>deleted</strong>" in card
    page = client.get(f"/plans/{plan_id}/")
    assert page.status_code == 200
    assert 'data-compensation-method="DELETE"' in page.content.decode()


def test_a_compensation_whose_class_became_per_call_waits_for_a_person_when_it_runs(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    """The plan started at once (every class per-run); then updating a dns record
    became per-call. Forcing the compensation must not write without a person: it
    becomes a conflict (base = before the step, proposed = the compensation), and the
    operator's resolution applies it."""
    rq_worker()
    _hold("dns-record/app-b")
    compensation = {"method": "PUT", "document": {"ip": "1", "restored": True}}
    plan_id = plan_fx.proposed_plan(api, run, _app_a_with_compensation(compensation))
    wait_for(lambda: _paused(plan_id, 2), timeout=30)
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "2"}
    ResourceKind.objects.filter(slug="dns-record").update(class_update="replace_shared_document")
    _agent_cancels_step(run, plan_id, 2)
    wait_for(lambda: plan_fx.plan_status(plan_id) == "partially_compensated", timeout=30)

    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "2"}  # nothing written
    body = plan_fx.read_plan(api, operator.token, plan_id)
    assert body["steps"][0]["compensation"]["status"] == "conflict"
    conflict = Conflict.objects.get(pk=body["steps"][0]["compensation"]["conflict"])
    assert conflict.origin == "undo" and conflict.status == "open"
    assert conflict.conflict_class_id == "replace_shared_document"
    assert conflict.base_version == "3" and conflict.base_document == {"ip": "1"}
    assert conflict.proposed_document == {"ip": "1", "restored": True}
    refused = AuditEvent.objects.get(event_type="plan.compensation_refused", details__plan=plan_id)
    assert refused.details["reason"] == "needs_approval"

    _take_proposed(api, operator, str(conflict.pk))
    wait_for(lambda: plan_fx.plan_status(plan_id) == "compensated", timeout=30)
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "1", "restored": True}


# --- §2: never erases a change it did not make ----------------------------------------


def _policy_step_resolved_then_step_two_held(
    api: Any, run: Any, operator: Any, compensation: dict[str, Any] | None
) -> str:
    """Step 1 (the policy) is stale when its turn comes; the operator takes the plan's
    document in the conflict, so step 1 applies through that resolution; step 2 is held."""
    step = plan_fx.patch_step(plan_fx.POLICY, '"41"', {"channels": ["pager"]})
    if compensation is not None:
        step["compensation"] = compensation
    _hold("dns-record/app-a")
    plan_id = plan_fx.proposed_plan(
        api, run, [step, plan_fx.patch_step("dns-record/app-a", '"3"', {"ip": "2"})]
    )
    plan_fx.bump_resource(plan_fx.POLICY, {"channels": ["email"], "owner": "someone"})
    plan_fx.approve_plan(api, operator, plan_id)

    def waiting_on_conflict() -> bool:
        error = PlanStep.objects.get(plan_id=plan_id, position=1).error
        return isinstance(error, dict) and bool(error.get("conflict"))

    wait_for(waiting_on_conflict, timeout=30)
    error = PlanStep.objects.get(plan_id=plan_id, position=1).error
    assert isinstance(error, dict)
    conflict_id = error["conflict"]
    resolved = api.post(
        f"/api/v1/conflicts/{conflict_id}/resolution",
        token=operator.token,
        body={"choice": "merge", "comment": "keep the owner, take the channels"},
    )
    assert resolved.status_code == 200, resolved.content
    wait_for(lambda: _paused(plan_id, 2), timeout=30)
    return plan_id


def test_a_compensation_of_a_step_a_person_resolved_never_overwrites_the_merge(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    """Today the explicit PUT compensation wrote the agent's pre-image over the
    resolver's merged version and the plan said `compensated`. Now it is a conflict for
    a person: base = before the step (the version the agent observed), current = the
    merge, proposed = the compensation; the plan is `partially_compensated`."""
    rq_worker()
    compensation = {"method": "PUT", "document": {"channels": ["email"]}}
    plan_id = _policy_step_resolved_then_step_two_held(api, run, operator, compensation)
    merged = plan_fx.resource_row(plan_fx.POLICY)
    assert merged.document == {"channels": ["pager"], "owner": "someone"}
    _agent_cancels_step(run, plan_id, 2)
    wait_for(lambda: plan_fx.plan_status(plan_id) == "partially_compensated", timeout=30)

    assert plan_fx.resource_row(plan_fx.POLICY).document == merged.document
    body = plan_fx.read_plan(api, operator.token, plan_id)
    assert body["steps"][0]["compensation"]["status"] == "conflict"
    conflict = Conflict.objects.get(pk=body["steps"][0]["compensation"]["conflict"])
    assert conflict.origin == "undo" and conflict.status == "open"
    assert conflict.base_version == "41" and conflict.base_document == {"channels": ["email"]}
    assert conflict.current_document == merged.document
    assert conflict.proposed_document == {"channels": ["email"]}
    refused = AuditEvent.objects.get(event_type="plan.compensation_refused", details__plan=plan_id)
    assert refused.details["reason"] == "applied_by_resolution"
    # The three-way page shows it.
    from django.test import Client

    client = Client()
    client.force_login(operator.user)
    page = client.get(f"/conflicts/{conflict.pk}/")
    assert page.status_code == 200
    _take_proposed(api, operator, str(conflict.pk))
    wait_for(lambda: plan_fx.plan_status(plan_id) == "compensated", timeout=30)
    assert plan_fx.resource_row(plan_fx.POLICY).document == {"channels": ["email"]}


def test_a_plan_follows_a_second_resolution_of_its_step_to_the_end(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    """Step 1 is stale, the operator takes the plan's document; that resolution's own
    write is stale too (someone wrote in between) and becomes a second conflict; its
    resolution applies. Today the plan read only the first resolution and waited in
    `executing` forever; now it goes on and applies step 2."""
    rq_worker()
    plan_id = plan_fx.proposed_plan(api, run, plan_fx.policy_then_app_a())
    plan_fx.bump_resource(plan_fx.POLICY, {"channels": ["email", "sms"]})
    plan_fx.approve_plan(api, operator, plan_id)

    def step_one_conflict() -> str | None:
        error = PlanStep.objects.get(plan_id=plan_id, position=1).error
        return str(error["conflict"]) if isinstance(error, dict) and error.get("conflict") else None

    wait_for(lambda: step_one_conflict() is not None, timeout=30)
    first = step_one_conflict()
    assert first is not None
    _hold(plan_fx.POLICY)  # the resolution's write waits while someone writes again
    _take_proposed(api, operator, first)
    resolution = Conflict.objects.get(pk=first).resolution_action
    assert resolution is not None
    wait_for(lambda: resolution.__class__.objects.get(pk=resolution.pk).status == "paused")
    plan_fx.bump_resource(plan_fx.POLICY, {"channels": ["email", "sms", "fax"]})
    kill_switch_set(scope=plan_fx.POLICY, engaged=False, reason="", actor=SYSTEM)
    wait_for(
        lambda: Conflict.objects.filter(action_id=resolution.pk, origin="write").exists(),
        timeout=30,
    )
    second = Conflict.objects.get(action_id=resolution.pk, origin="write")
    _take_proposed(api, operator, str(second.pk))
    wait_for(lambda: plan_fx.plan_status(plan_id) == "applied", timeout=30)
    assert plan_fx.resource_row(plan_fx.POLICY).document == {"channels": ["pager"]}
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "2"}
    second.refresh_from_db()
    body = plan_fx.read_plan(api, run.token, plan_id)
    assert body["steps"][0]["applied"]["by_action"] == str(second.resolution_action_id)


def test_earlier_steps_wait_while_a_later_compensation_is_a_conflict(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    """Steps 1 (app-a), 2 (the policy) and 3 (app-c) apply, step 4 is held and
    cancelled; someone changed the policy after step 2, so its compensation is a
    conflict. Today step 1 was compensated anyway; now it waits until the conflict is
    settled (and re-reading the blocked plan moves nothing)."""
    rq_worker()
    _hold("dns-record/app-b")
    steps = [
        plan_fx.patch_step("dns-record/app-a", '"3"', {"ip": "2"}),
        plan_fx.patch_step(plan_fx.POLICY, '"41"', {"channels": ["pager"]}),
        plan_fx.create_step("dns-record/app-c", {"c": 1}),
        plan_fx.create_step("dns-record/app-b", {"b": 1}),
    ]
    plan_id = plan_fx.proposed_plan(api, run, steps)
    plan_fx.approve_plan(api, operator, plan_id)
    wait_for(lambda: _paused(plan_id, 4), timeout=30)
    plan_fx.bump_resource(plan_fx.POLICY, {"channels": ["pager", "sms"]})
    _agent_cancels_step(run, plan_id, 4)
    wait_for(lambda: plan_fx.plan_status(plan_id) == "partially_compensated", timeout=30)
    for _ in range(3):
        plan_advance(plan_id=plan_id)
    ended = AuditEvent.objects.filter(event_type="plan.ended", details__plan=plan_id)
    assert ended.count() == 1  # reading a blocked plan again moves nothing
    assert plan_fx.plan_status(plan_id) == "partially_compensated"
    body = plan_fx.read_plan(api, operator.token, plan_id)
    assert [s["compensation"]["status"] for s in body["steps"][:3]] == [
        "none",
        "conflict",
        "compensated",
    ]
    assert plan_fx.resource_row("dns-record/app-c").deleted
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "2"}  # not yet

    _take_proposed(api, operator, body["steps"][1]["compensation"]["conflict"])
    wait_for(lambda: plan_fx.plan_status(plan_id) == "compensated", timeout=30)
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "1"}
    assert plan_fx.resource_row(plan_fx.POLICY).document == {"channels": ["email"]}
    events = list(
        AuditEvent.objects.filter(details__plan=plan_id, event_type__startswith="plan.compensation")
        .order_by("seq")
        .values_list("event_type", "details__step")
    )
    resolved = events.index(("plan.compensation_resolved", 2))
    assert events[resolved + 1 :] == [
        ("plan.compensation_resumed", 1),
        ("plan.compensation_started", 1),
        ("plan.compensation_applied", 1),
    ]


def test_a_compensation_opens_its_own_record_beside_an_earlier_failed_undo(
    api: Any, run: Any, plan_world: Any, rq_worker: Any
) -> None:
    """Someone's undo of step 1 failed for good before the plan compensated. Today
    the compensation took that failed record over (its restore, its outcome) and
    failed with it; now it opens its own operation and the failed one stays as it was."""
    rq_worker()
    _hold("dns-record/app-b")
    compensation = {"method": "PUT", "document": {"ip": "1", "by": "compensation"}}
    plan_id = plan_fx.proposed_plan(api, run, _app_a_with_compensation(compensation))
    wait_for(lambda: _paused(plan_id, 2), timeout=30)
    applied = PlanStep.objects.get(plan_id=plan_id, position=1).applied_operation
    assert applied is not None
    failed_outcome = {"reason": "window_expired", "message": "the undo window has closed"}
    failed = Operation.objects.create(
        action_id=applied.action_id,
        undo_of=applied,
        fence=1,
        status="failed",
        outcome=failed_outcome,
    )
    _agent_cancels_step(run, plan_id, 2)
    wait_for(lambda: plan_fx.plan_status(plan_id) == "compensated", timeout=30)

    step = PlanStep.objects.get(plan_id=plan_id, position=1)
    assert step.compensation_operation_id not in (None, failed.pk)
    failed.refresh_from_db()
    assert failed.status == "failed" and failed.outcome == failed_outcome
    assert failed.restore is None and failed.compensation is False
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "1", "by": "compensation"}


# --- §3: the reconciler resumes every plan, however many are parked -------------------


def test_plans_resume_reaches_a_lost_plan_behind_250_plans_parked_on_people(
    api: Any, run: Any, plan_world: Any
) -> None:
    """250 plans wait for people (a step paused, older than everything else). A plan
    whose job Redis lost (no worker ran it) must still be moved by one reconciler pass;
    today the pass read only the 200 oldest plans, all parked."""
    from datetime import timedelta

    from django.utils import timezone

    from approvals.models import Action, Plan
    from approvals.services.plan_engine import plans_resume
    from ownership.models import ConflictClass

    cls = ConflictClass.objects.get(slug="recompute_field")
    plans = Plan.objects.bulk_create(
        Plan(run=run.run, agent=run.agent, status="executing") for _ in range(250)
    )
    actions = Action.objects.bulk_create(
        Action(
            run=run.run,
            agent=run.agent,
            kind_id="dns-record",
            name=f"app-parked-{n}",
            operation="update",
            payload_format="merge_patch",
            payload={"ip": "p"},
            observed_version=1,
            conflict_class=cls,
            status="paused",
        )
        for n in range(250)
    )
    PlanStep.objects.bulk_create(
        PlanStep(
            plan=plan,
            position=1,
            kind_id="dns-record",
            name=action.name,
            operation="update",
            payload_format="merge_patch",
            payload={"ip": "p"},
            observed_version=1,
            conflict_class=cls,
            status="executing",
            action=action,
        )
        for plan, action in zip(plans, actions, strict=True)
    )
    Plan.objects.filter(pk__in=[p.pk for p in plans]).update(
        updated_at=timezone.now() - timedelta(hours=1)
    )
    lost = plan_fx.proposed_plan(
        api, run, [plan_fx.patch_step("dns-record/app-a", '"3"', {"ip": "2"})]
    )
    assert plan_fx.plan_status(lost) == "executing"
    assert plan_fx.step_action(lost, 1) is None  # its job never ran

    plans_resume()
    assert plan_fx.step_action(lost, 1) is not None  # started by the reconciler
    assert Plan.objects.filter(pk__in=[p.pk for p in plans], status="executing").count() == 250


def test_ending_the_run_never_reaches_an_unapproved_delete_compensation(
    api: Any, run: Any, plan_world: Any, rq_worker: Any
) -> None:
    """The other way to force a compensation: the agent ends its run while step 2 is
    held. Deleting a dns record is per-call; today the plan ran at once and the run's
    end deleted app-a with nobody approving. Now the plan waits for its approval, and
    the run's end cancels it with nothing written."""
    from approvals.services.runs import run_finish

    ResourceKind.objects.filter(slug="dns-record").update(class_delete="replace_shared_document")
    rq_worker()
    _hold("dns-record/app-b")
    plan_id = plan_fx.proposed_plan(api, run, _app_a_with_compensation({"method": "DELETE"}))
    wait_for(lambda: plan_fx.plan_status(plan_id) != "executing" or _paused(plan_id, 2), timeout=30)
    run_finish(run=run.run, actor=Actor.run(run.run))
    plan_advance(plan_id=plan_id)
    wait_for(lambda: plan_fx.plan_status(plan_id) not in ("executing", "compensating"), timeout=30)
    assert not plan_fx.resource_row("dns-record/app-a").deleted
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "1"}
    assert plan_fx.plan_status(plan_id) == "cancelled"
