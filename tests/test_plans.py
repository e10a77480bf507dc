"""Plans (issue 13): one change across several resources, approved as one, applied in
order by real RQ workers, compensated in reverse when a later step fails for good.

Real PostgreSQL, a private Redis and `rqworker` processes. The run's write set
covers `notification-policy/prod-alerts` (update: replace_shared_document,
per-call, resolved by `operators`) and `dns-record/app-*` (create: add_unique,
update: recompute_field, both per-run and retryable by the agent).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from approvals.models import Action, Plan, PlanStep
from audit.models import AuditEvent
from audit.services import Actor
from ownership.models import Resource, ResourceVersion
from tests.fixtures.core import make_resource
from tests.fixtures.engine import wait_for
from tests.fixtures.plans import (
    POLICY,
    approve_plan,
    bump_resource,
    create_step,
    patch_step,
    plan_status,
    policy_then_app_a,
    propose_plan,
    proposed_plan,
    put_step,
    read_plan,
    resource_row,
    step_action,
    three_steps,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_three_step_plan_across_two_kinds_is_approved_once_and_applied_in_order(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    worker = rq_worker()
    response = propose_plan(api, run, three_steps())
    assert response.status_code == 202, response.content
    assert response["Location"] == f"/api/v1/plans/{response.json()['id']}"
    plan = response.json()
    assert plan["status"] == "pending_approval"
    assert [s["status"] for s in plan["steps"]] == ["pending"] * 3
    assert Action.objects.filter(run=run.run).count() == 0  # nothing runs before approval

    approved_at = time.monotonic()
    approve_plan(api, operator, plan["id"])
    wait_for(lambda: plan_status(plan["id"]) == "applied", timeout=30, interval=0.01)
    print(f"three-step plan: approved -> applied in {time.monotonic() - approved_at:.3f} s")

    body = read_plan(api, run.token, plan["id"])
    assert [s["status"] for s in body["steps"]] == ["applied"] * 3, worker.output()
    assert resource_row("dns-record/app-a").document == {"ip": "2"}
    assert resource_row("dns-record/app-new").document == {"ip": "9"}
    assert resource_row(POLICY).document == {"channels": ["pager"]}
    # One approval for the plan; none for its steps' actions.
    assert run.run.approvals.filter(subject="action").count() == 0
    # The order: each step's write committed after the previous one (fences and
    # audit rows increase along the steps).
    fences = [s["applied"]["fence"] for s in body["steps"]]
    assert fences == sorted(fences) and len(set(fences)) == 3
    applied = list(
        AuditEvent.objects.filter(event_type="write.applied", run_id=run.run.pk)
        .order_by("seq")
        .values_list("resource", flat=True)
    )
    assert applied == ["dns-record/app-a", "dns-record/app-new", POLICY]
    events = list(
        AuditEvent.objects.filter(details__plan=plan["id"])
        .order_by("seq")
        .values_list("event_type", flat=True)
    )
    assert events[0] == "plan.proposed" and events[-1] == "plan.ended"
    assert events.count("plan.step_applied") == 3
    assert "approval.approved" in events


def test_step_three_refused_as_stale_compensates_steps_two_and_one_in_reverse(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    """dns-record updates are the agent's to retry: a stale step 3 stops the plan."""
    make_resource("dns-record/app-c", {"ip": "c"}, version=5)
    worker = rq_worker()
    steps = [
        patch_step("dns-record/app-a", '"3"', {"ip": "2"}),
        create_step("dns-record/app-new", {"ip": "9"}),
        put_step("dns-record/app-c", '"5"', {"ip": "c2"}),
    ]
    # Hold the plan in its approval while someone else moves app-c on (a per-call
    # step makes the plan wait for a person).
    steps.append(patch_step(POLICY, '"41"', {"x": 1}))
    steps[2], steps[3] = steps[3], steps[2]  # policy is step 3, app-c step 4
    plan_id = proposed_plan(api, run, steps)
    Resource.objects.filter(kind_id="dns-record", name="app-c").update(
        document={"ip": "someone"}, version=6
    )
    ResourceVersion.objects.create(
        resource=resource_row("dns-record/app-c"),
        version=6,
        document={"ip": "someone"},
        operation="seed",
    )
    approve_plan(api, operator, plan_id)
    wait_for(lambda: plan_status(plan_id) == "compensated", timeout=40)

    body = read_plan(api, run.token, plan_id)
    assert [s["status"] for s in body["steps"]] == ["applied", "applied", "applied", "refused"]
    assert body["error"]["step"] == 4 and body["error"]["code"] == "stale_version"
    assert [s["compensation"]["status"] for s in body["steps"][:3]] == ["compensated"] * 3
    # Back to their previous documents, versions moved forward (never rewound).
    app_a = resource_row("dns-record/app-a")
    assert app_a.document == {"ip": "1"} and app_a.version == 5
    assert resource_row("dns-record/app-new").deleted
    policy = resource_row(POLICY)
    assert policy.document == {"channels": ["email"]} and policy.version == 43
    assert resource_row("dns-record/app-c").document == {"ip": "someone"}
    # Compensated in reverse: policy, then app-new, then app-a.
    undone = list(
        AuditEvent.objects.filter(event_type="write.undone", run_id=run.run.pk)
        .order_by("seq")
        .values_list("resource", flat=True)
    )
    assert undone == [POLICY, "dns-record/app-new", "dns-record/app-a"], worker.output()


@pytest.mark.parametrize(
    ("steps", "status", "code"),
    [
        (
            [put_step("dns-record/other", '"1"', {})],
            403,
            "not_in_write_set",
        ),
        (
            [
                patch_step("dns-record/app-a", '"3"', {"ip": "2"}),
                patch_step("dns-record/app-a", '"3"', {"ip": "3"}),
            ],
            422,
            "validation_error",
        ),
        (
            [create_step(f"dns-record/app-{n}", {}) for n in range(11)],
            422,
            "validation_error",
        ),
        (
            [patch_step("dns-record/app-a", '"2"', {"ip": "2"})],
            412,
            "stale_version",
        ),
        (
            [{"resource": "dns-record/app-a", "method": "PATCH", "patch": {"ip": "2"}}],
            428,
            "precondition_required",
        ),
        (
            [
                {
                    "resource": "dns-record/app-a",
                    "method": "PATCH",
                    "if_match": '"3"',
                    "document": {"ip": "2"},
                }
            ],
            422,
            "validation_error",
        ),
        (
            [
                {
                    "resource": "dns-record/app-a",
                    "method": "PATCH",
                    "if_match": '"3"',
                    "patch": {"ip": "2"},
                    "surprise": 1,
                }
            ],
            422,
            "validation_error",
        ),
        ([], 422, "validation_error"),
    ],
    ids=[
        "outside-write-set",
        "duplicate",
        "too-many",
        "stale",
        "no-if-match",
        "wrong-body",
        "unknown-field",
        "empty",
    ],
)
def test_a_bad_plan_is_a_problem_and_records_nothing(
    api: Any, run: Any, plan_world: Any, steps: Any, status: int, code: str
) -> None:
    events_before = AuditEvent.objects.exclude(event_type="plan.refused_stale").count()
    response = propose_plan(api, run, steps)
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == code
    assert Plan.objects.count() == 0 and PlanStep.objects.count() == 0
    assert Action.objects.count() == 0
    assert AuditEvent.objects.exclude(event_type="plan.refused_stale").count() == events_before


# --- A compensation that finds someone's later write, and a step a person resolves ----


def _take_proposed(api: Any, person: Any, conflict_id: str) -> None:
    """The resolver settles the conflict with the proposed side (the plan's write, or
    what its compensation would restore)."""
    resolved = api.post(
        f"/api/v1/conflicts/{conflict_id}/resolution",
        token=person.token,
        body={"choice": "take_proposed", "comment": "as the plan says"},
    )
    assert resolved.status_code == 200, resolved.content


def test_a_compensation_over_a_later_write_becomes_a_conflict_and_resolving_it_finishes(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    """Step 1 (the policy) applies; a kill switch holds step 2; a person changes the
    policy; step 2 is cancelled: the policy's compensation must not overwrite that
    change — it becomes a conflict for the class's resolver (operators), the plan
    ends partially_compensated, and the operator's resolution finishes it."""
    from approvals.services.actions import action_cancel
    from approvals.services.plan_engine import plan_advance
    from console.services import kill_switch_set

    worker = rq_worker()
    kill_switch_set(
        scope="dns-record/app-a", engaged=True, reason="hold step 2", actor=Actor.system("t")
    )
    plan_id = proposed_plan(api, run, policy_then_app_a())
    approve_plan(api, operator, plan_id)
    wait_for(
        lambda: (a := step_action(plan_id, 2)) is not None and a.status == "paused", timeout=30
    )
    assert resource_row(POLICY).document == {"channels": ["pager"]}

    bump_resource(POLICY, {"channels": ["pager", "sms"]})  # a person's change after step 1
    step_two = step_action(plan_id, 2)
    assert step_two is not None
    action_cancel(action=step_two, actor=Actor.person(operator.user))
    plan_advance(plan_id=plan_id)  # the reconciler's move, without waiting for its tick
    wait_for(lambda: plan_status(plan_id) == "partially_compensated", timeout=30)

    body = read_plan(api, operator.token, plan_id)
    compensation = body["steps"][0]["compensation"]
    assert compensation["status"] == "conflict", worker.output()
    assert resource_row(POLICY).document == {"channels": ["pager", "sms"]}  # not overwritten
    conflict = api.get(f"/api/v1/conflicts/{compensation['conflict']}", token=operator.token)
    assert conflict.status_code == 200, conflict.content
    assert conflict.json()["origin"] == "undo"
    assert AuditEvent.objects.filter(
        event_type="plan.compensation_refused", details__plan=plan_id
    ).exists()

    _take_proposed(api, operator, compensation["conflict"])
    wait_for(lambda: plan_status(plan_id) == "compensated", timeout=30)
    assert resource_row(POLICY).document == {"channels": ["email"]}
    body = read_plan(api, operator.token, plan_id)
    assert body["steps"][0]["compensation"]["status"] == "resolved"
    assert [s["status"] for s in body["steps"]] == ["applied", "refused"]


def test_a_stale_step_routed_to_a_person_waits_and_their_resolution_resumes_the_plan(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    worker = rq_worker()
    plan_id = proposed_plan(api, run, policy_then_app_a())
    bump_resource(POLICY, {"channels": ["email", "sms"]})  # moved on while the plan waited
    approve_plan(api, operator, plan_id)

    def waiting_on_conflict() -> bool:
        step = PlanStep.objects.get(plan_id=plan_id, position=1)
        return isinstance(step.error, dict) and bool(step.error.get("conflict"))

    wait_for(waiting_on_conflict, timeout=30)
    body = read_plan(api, run.token, plan_id)
    assert body["status"] == "executing"
    assert [s["status"] for s in body["steps"]] == ["executing", "pending"], worker.output()
    conflict_id = body["steps"][0]["error"]["conflict"]
    _take_proposed(api, operator, conflict_id)
    wait_for(lambda: plan_status(plan_id) == "applied", timeout=30)
    assert resource_row(POLICY).document == {"channels": ["pager"]}
    assert resource_row("dns-record/app-a").document == {"ip": "2"}


def test_an_approved_plan_survives_a_redis_flushall(
    api: Any, run: Any, plan_world: Any, rq_worker: Any, engine_redis: Any
) -> None:
    """Per-run steps only: the plan runs at once. Redis loses its job before any
    worker runs; the reconciler (PostgreSQL is the outbox) still carries it through."""
    from approvals.outbox import engine_redis as redis_of_the_engine
    from approvals.services.reconcile import reconcile

    steps = [
        patch_step("dns-record/app-a", '"3"', {"ip": "2"}),
        create_step("dns-record/app-b", {"ip": "b"}),
    ]
    response = propose_plan(api, run, steps)
    assert response.status_code == 202, response.content
    plan_id = response.json()["id"]
    assert response.json()["status"] == "executing"
    redis_of_the_engine().flushall()
    rq_worker()

    def reconciled_to_the_end() -> bool:
        reconcile()
        return plan_status(plan_id) == "applied"

    wait_for(reconciled_to_the_end, timeout=40, interval=0.5)
    assert resource_row("dns-record/app-a").document == {"ip": "2"}
    assert resource_row("dns-record/app-b").document == {"ip": "b"}
