"""Plans (issue 13): one change across several resources, approved as one, applied in
order by real RQ workers, compensated in reverse when a later step fails for good.

Real PostgreSQL, a private Redis and `rqworker` processes. The run's write set
covers `notification-policy/prod-alerts` (update: replace_shared_document,
per-call, resolved by `operators`) and `dns-record/app-*` (create: add_unique,
update: recompute_field, both per-run and retryable by the agent).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from approvals.models import Action, Plan, PlanStep
from audit.models import AuditEvent
from ownership.models import Resource, ResourceVersion
from tests.fixtures.core import make_resource
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

POLICY = "notification-policy/prod-alerts"


def _key() -> str:
    return f"plan-{uuid.uuid4().hex}"


def _propose(api: Any, run: Any, steps: list[dict[str, Any]], **extra: Any) -> Any:
    return api.post(
        f"/api/v1/runs/{run.run.pk}/plans",
        token=run.token,
        body={"reason": "move the pointer and its alerts", "steps": steps, **extra},
        headers={"Idempotency-Key": _key()},
    )


def _plan(api: Any, token: str, plan_id: str) -> dict[str, Any]:
    response = api.get(f"/api/v1/plans/{plan_id}", token=token)
    assert response.status_code == 200, response.content
    return response.json()


def _status(plan_id: str) -> str:
    return str(Plan.objects.values_list("status", flat=True).get(pk=plan_id))


def _approve(api: Any, person: Any, plan_id: str) -> None:
    listing = api.get("/api/v1/approvals?status=pending", token=person.token)
    assert listing.status_code == 200, listing.content
    [item] = [i for i in listing.json()["items"] if i.get("plan") == plan_id]
    assert item["subject"] == "plan"
    decided = api.post(
        f"/api/v1/approvals/{item['id']}/decision",
        token=person.token,
        body={"decision": "approve", "comment": "one change, three writes"},
    )
    assert decided.status_code == 200, decided.content


def _document(identifier: str) -> Any:
    kind, name = identifier.split("/", 1)
    return Resource.objects.get(kind_id=kind, name=name)


def _three_steps() -> list[dict[str, Any]]:
    return [
        {"resource": "dns-record/app-a", "method": "PATCH", "if_match": '"3"', "patch": {"ip": "2"}},
        {"resource": "dns-record/app-new", "method": "PUT", "if_none_match": "*",
         "document": {"ip": "9"}},
        {"resource": POLICY, "method": "PATCH", "if_match": '"41"',
         "patch": {"channels": ["pager"]}},
    ]


@pytest.fixture
def world(db: Any) -> dict[str, Any]:
    return {
        "app_a": make_resource("dns-record/app-a", {"ip": "1"}, version=3),
        "policy": make_resource(POLICY, {"channels": ["email"]}, version=41),
    }


def test_a_three_step_plan_across_two_kinds_is_approved_once_and_applied_in_order(
    api: Any, run: Any, operator: Any, world: Any, rq_worker: Any
) -> None:
    worker = rq_worker()
    response = _propose(api, run, _three_steps())
    assert response.status_code == 202, response.content
    assert response["Location"] == f"/api/v1/plans/{response.json()['id']}"
    plan = response.json()
    assert plan["status"] == "pending_approval"
    assert [s["status"] for s in plan["steps"]] == ["pending"] * 3
    assert Action.objects.filter(run=run.run).count() == 0  # nothing runs before approval

    _approve(api, operator, plan["id"])
    wait_for(lambda: _status(plan["id"]) == "applied", timeout=30)

    body = _plan(api, run.token, plan["id"])
    assert [s["status"] for s in body["steps"]] == ["applied"] * 3, worker.output()
    assert _document("dns-record/app-a").document == {"ip": "2"}
    assert _document("dns-record/app-new").document == {"ip": "9"}
    assert _document(POLICY).document == {"channels": ["pager"]}
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
        AuditEvent.objects.filter(details__plan=plan["id"]).order_by("seq").values_list(
            "event_type", flat=True
        )
    )
    assert events[0] == "plan.proposed" and events[-1] == "plan.ended"
    assert events.count("plan.step_applied") == 3
    assert "approval.approved" in events


def test_step_three_refused_as_stale_compensates_steps_two_and_one_in_reverse(
    api: Any, run: Any, operator: Any, world: Any, rq_worker: Any
) -> None:
    """dns-record updates are the agent's to retry: a stale step 3 stops the plan."""
    make_resource("dns-record/app-c", {"ip": "c"}, version=5)
    worker = rq_worker()
    steps = [
        {"resource": "dns-record/app-a", "method": "PATCH", "if_match": '"3"', "patch": {"ip": "2"}},
        {"resource": "dns-record/app-new", "method": "PUT", "if_none_match": "*",
         "document": {"ip": "9"}},
        {"resource": "dns-record/app-c", "method": "PUT", "if_match": '"5"',
         "document": {"ip": "c2"}},
    ]
    # Hold the plan in its approval while someone else moves app-c on (a per-call
    # step makes the plan wait for a person).
    steps.append(
        {"resource": POLICY, "method": "PATCH", "if_match": '"41"', "patch": {"x": 1}}
    )
    steps[2], steps[3] = steps[3], steps[2]  # policy is step 3, app-c step 4
    response = _propose(api, run, steps)
    assert response.status_code == 202, response.content
    plan_id = response.json()["id"]
    Resource.objects.filter(kind_id="dns-record", name="app-c").update(
        document={"ip": "someone"}, version=6
    )
    ResourceVersion.objects.create(
        resource=_document("dns-record/app-c"), version=6, document={"ip": "someone"},
        operation="seed",
    )
    _approve(api, operator, plan_id)
    wait_for(lambda: _status(plan_id) == "compensated", timeout=40)

    body = _plan(api, run.token, plan_id)
    assert [s["status"] for s in body["steps"]] == ["applied", "applied", "applied", "refused"]
    assert body["error"]["step"] == 4 and body["error"]["code"] == "stale_version"
    assert [s["compensation"]["status"] for s in body["steps"][:3]] == ["compensated"] * 3
    # Back to their previous documents, versions moved forward (never rewound).
    app_a = _document("dns-record/app-a")
    assert app_a.document == {"ip": "1"} and app_a.version == 5
    assert _document("dns-record/app-new").deleted
    policy = _document(POLICY)
    assert policy.document == {"channels": ["email"]} and policy.version == 43
    assert _document("dns-record/app-c").document == {"ip": "someone"}
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
            [{"resource": "dns-record/other", "method": "PUT", "if_match": '"1"',
              "document": {}}],
            403,
            "not_in_write_set",
        ),
        (
            [
                {"resource": "dns-record/app-a", "method": "PATCH", "if_match": '"3"',
                 "patch": {"ip": "2"}},
                {"resource": "dns-record/app-a", "method": "PATCH", "if_match": '"3"',
                 "patch": {"ip": "3"}},
            ],
            422,
            "validation_error",
        ),
        (
            [{"resource": f"dns-record/app-{n}", "method": "PUT", "if_none_match": "*",
              "document": {}} for n in range(11)],
            422,
            "validation_error",
        ),
        (
            [{"resource": "dns-record/app-a", "method": "PATCH", "if_match": '"2"',
              "patch": {"ip": "2"}}],
            412,
            "stale_version",
        ),
        (
            [{"resource": "dns-record/app-a", "method": "PATCH", "patch": {"ip": "2"}}],
            428,
            "precondition_required",
        ),
        (
            [{"resource": "dns-record/app-a", "method": "PATCH", "if_match": '"3"',
              "document": {"ip": "2"}}],
            422,
            "validation_error",
        ),
        (
            [{"resource": "dns-record/app-a", "method": "PATCH", "if_match": '"3"',
              "patch": {"ip": "2"}, "surprise": 1}],
            422,
            "validation_error",
        ),
        ([], 422, "validation_error"),
    ],
    ids=["outside-write-set", "duplicate", "too-many", "stale", "no-if-match", "wrong-body",
         "unknown-field", "empty"],
)
def test_a_bad_plan_is_a_problem_and_records_nothing(
    api: Any, run: Any, world: Any, steps: Any, status: int, code: str
) -> None:
    events_before = AuditEvent.objects.exclude(event_type="plan.refused_stale").count()
    response = _propose(api, run, steps)
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == code
    assert Plan.objects.count() == 0 and PlanStep.objects.count() == 0
    assert Action.objects.count() == 0
    assert AuditEvent.objects.exclude(event_type="plan.refused_stale").count() == events_before
