"""Plans (issue 13): one change across several resources, approved as one, applied in
order by real RQ workers, compensated in reverse when a later step fails for good.

Real PostgreSQL, a private Redis and `rqworker` processes. The run's write set
covers `notification-policy/prod-alerts` (update: replace_shared_document,
per-call, resolved by `operators`) and `dns-record/app-*` (create: add_unique,
update: recompute_field, both per-run and retryable by the agent).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from approvals.models import Action, Plan, PlanStep
from approvals.services.runs import run_revoke
from audit.models import AuditEvent
from audit.services import Actor
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


def _proposed(api: Any, run: Any, steps: list[dict[str, Any]]) -> str:
    """The id of the plan `run` proposed (accepted, 202)."""
    response = _propose(api, run, steps)
    assert response.status_code == 202, response.content
    return str(response.json()["id"])


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
    decided = api.decide(
        item["id"], "approve", token=person.token, comment="one change, three writes"
    )
    assert decided.status_code == 200, decided.content


def _document(identifier: str) -> Any:
    kind, name = identifier.split("/", 1)
    return Resource.objects.get(kind_id=kind, name=name)


def _patch(resource: str, etag: str, patch: dict[str, Any]) -> dict[str, Any]:
    return {"resource": resource, "method": "PATCH", "if_match": etag, "patch": patch}


def _put(resource: str, etag: str, document: dict[str, Any]) -> dict[str, Any]:
    return {"resource": resource, "method": "PUT", "if_match": etag, "document": document}


def _create(resource: str, document: dict[str, Any]) -> dict[str, Any]:
    return {"resource": resource, "method": "PUT", "if_none_match": "*", "document": document}


def _policy_then_app_a() -> list[dict[str, Any]]:
    return [
        _patch(POLICY, '"41"', {"channels": ["pager"]}),
        _patch("dns-record/app-a", '"3"', {"ip": "2"}),
    ]


def _three_steps() -> list[dict[str, Any]]:
    return [
        _patch("dns-record/app-a", '"3"', {"ip": "2"}),
        _create("dns-record/app-new", {"ip": "9"}),
        _patch(POLICY, '"41"', {"channels": ["pager"]}),
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

    approved_at = time.monotonic()
    _approve(api, operator, plan["id"])
    wait_for(lambda: _status(plan["id"]) == "applied", timeout=30, interval=0.01)
    print(f"three-step plan: approved -> applied in {time.monotonic() - approved_at:.3f} s")

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
        AuditEvent.objects.filter(details__plan=plan["id"])
        .order_by("seq")
        .values_list("event_type", flat=True)
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
        _patch("dns-record/app-a", '"3"', {"ip": "2"}),
        _create("dns-record/app-new", {"ip": "9"}),
        _put("dns-record/app-c", '"5"', {"ip": "c2"}),
    ]
    # Hold the plan in its approval while someone else moves app-c on (a per-call
    # step makes the plan wait for a person).
    steps.append(_patch(POLICY, '"41"', {"x": 1}))
    steps[2], steps[3] = steps[3], steps[2]  # policy is step 3, app-c step 4
    plan_id = _proposed(api, run, steps)
    Resource.objects.filter(kind_id="dns-record", name="app-c").update(
        document={"ip": "someone"}, version=6
    )
    ResourceVersion.objects.create(
        resource=_document("dns-record/app-c"),
        version=6,
        document={"ip": "someone"},
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
            [_put("dns-record/other", '"1"', {})],
            403,
            "not_in_write_set",
        ),
        (
            [
                _patch("dns-record/app-a", '"3"', {"ip": "2"}),
                _patch("dns-record/app-a", '"3"', {"ip": "3"}),
            ],
            422,
            "validation_error",
        ),
        (
            [_create(f"dns-record/app-{n}", {}) for n in range(11)],
            422,
            "validation_error",
        ),
        (
            [_patch("dns-record/app-a", '"2"', {"ip": "2"})],
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


# --- A compensation that finds someone's later write, and a step a person resolves ----


def _bump(identifier: str, document: dict[str, Any]) -> None:
    """Someone else's write (a person, another system) moves the resource on."""
    resource = _document(identifier)
    Resource.objects.filter(pk=resource.pk).update(document=document, version=resource.version + 1)
    ResourceVersion.objects.create(
        resource=resource, version=resource.version + 1, document=document, operation="seed"
    )


def _take_proposed(api: Any, person: Any, conflict_id: str) -> None:
    """The resolver settles the conflict with the proposed side (the plan's write, or
    what its compensation would restore)."""
    resolved = api.post(
        f"/api/v1/conflicts/{conflict_id}/resolution",
        token=person.token,
        body={"choice": "take_proposed", "comment": "as the plan says"},
    )
    assert resolved.status_code == 200, resolved.content


def _step_action(plan_id: str, position: int) -> Action | None:
    step = PlanStep.objects.select_related("action").get(plan_id=plan_id, position=position)
    return step.action


def test_a_compensation_over_a_later_write_becomes_a_conflict_and_resolving_it_finishes(
    api: Any, run: Any, operator: Any, world: Any, rq_worker: Any
) -> None:
    """Step 1 (the policy) applies; a kill switch holds step 2; a person changes the
    policy; step 2 is cancelled: the policy's compensation must not overwrite that
    change — it becomes a conflict for the class's resolver (operators), the plan
    ends partially_compensated, and the operator's resolution finishes it."""
    from approvals.services.actions import action_cancel
    from approvals.services.plan_engine import plan_advance
    from audit.services import Actor
    from console.services import kill_switch_set

    worker = rq_worker()
    kill_switch_set(
        scope="dns-record/app-a", engaged=True, reason="hold step 2", actor=Actor.system("t")
    )
    plan_id = _proposed(api, run, _policy_then_app_a())
    _approve(api, operator, plan_id)
    wait_for(
        lambda: (a := _step_action(plan_id, 2)) is not None and a.status == "paused", timeout=30
    )
    assert _document(POLICY).document == {"channels": ["pager"]}

    _bump(POLICY, {"channels": ["pager", "sms"]})  # a person's change after step 1
    step_two = _step_action(plan_id, 2)
    assert step_two is not None
    action_cancel(action=step_two, actor=Actor.person(operator.user))
    plan_advance(plan_id=plan_id)  # the reconciler's move, without waiting for its tick
    wait_for(lambda: _status(plan_id) == "partially_compensated", timeout=30)

    body = _plan(api, operator.token, plan_id)
    compensation = body["steps"][0]["compensation"]
    assert compensation["status"] == "conflict", worker.output()
    assert _document(POLICY).document == {"channels": ["pager", "sms"]}  # not overwritten
    conflict = api.get(f"/api/v1/conflicts/{compensation['conflict']}", token=operator.token)
    assert conflict.status_code == 200, conflict.content
    assert conflict.json()["origin"] == "undo"
    assert AuditEvent.objects.filter(
        event_type="plan.compensation_refused", details__plan=plan_id
    ).exists()

    _take_proposed(api, operator, compensation["conflict"])
    wait_for(lambda: _status(plan_id) == "compensated", timeout=30)
    assert _document(POLICY).document == {"channels": ["email"]}
    body = _plan(api, operator.token, plan_id)
    assert body["steps"][0]["compensation"]["status"] == "resolved"
    assert [s["status"] for s in body["steps"]] == ["applied", "refused"]


def test_a_stale_step_routed_to_a_person_waits_and_their_resolution_resumes_the_plan(
    api: Any, run: Any, operator: Any, world: Any, rq_worker: Any
) -> None:
    worker = rq_worker()
    plan_id = _proposed(api, run, _policy_then_app_a())
    _bump(POLICY, {"channels": ["email", "sms"]})  # moved on while the plan waited
    _approve(api, operator, plan_id)

    def waiting_on_conflict() -> bool:
        step = PlanStep.objects.get(plan_id=plan_id, position=1)
        return isinstance(step.error, dict) and bool(step.error.get("conflict"))

    wait_for(waiting_on_conflict, timeout=30)
    body = _plan(api, run.token, plan_id)
    assert body["status"] == "executing"
    assert [s["status"] for s in body["steps"]] == ["executing", "pending"], worker.output()
    conflict_id = body["steps"][0]["error"]["conflict"]
    _take_proposed(api, operator, conflict_id)
    wait_for(lambda: _status(plan_id) == "applied", timeout=30)
    assert _document(POLICY).document == {"channels": ["pager"]}
    assert _document("dns-record/app-a").document == {"ip": "2"}


def test_an_approved_plan_survives_a_redis_flushall(
    api: Any, run: Any, world: Any, rq_worker: Any, engine_redis: Any
) -> None:
    """Per-run steps only: the plan runs at once. Redis loses its job before any
    worker runs; the reconciler (PostgreSQL is the outbox) still carries it through."""
    from approvals.outbox import engine_redis as redis_of_the_engine
    from approvals.services.reconcile import reconcile

    steps = [
        _patch("dns-record/app-a", '"3"', {"ip": "2"}),
        _create("dns-record/app-b", {"ip": "b"}),
    ]
    response = _propose(api, run, steps)
    assert response.status_code == 202, response.content
    plan_id = response.json()["id"]
    assert response.json()["status"] == "executing"
    redis_of_the_engine().flushall()
    rq_worker()

    def reconciled_to_the_end() -> bool:
        reconcile()
        return _status(plan_id) == "applied"

    wait_for(reconciled_to_the_end, timeout=40, interval=0.5)
    assert _document("dns-record/app-a").document == {"ip": "2"}
    assert _document("dns-record/app-b").document == {"ip": "b"}


# --- A worker killed at every point ---------------------------------------------------


def _applied_at_most_once(run_id: Any) -> None:
    for action in Action.objects.filter(run_id=run_id):
        writes = ResourceVersion.objects.filter(action_id=action.pk).exclude(operation="undo")
        assert writes.count() <= 1, f"{action.resource_identifier} written twice"
        undos = ResourceVersion.objects.filter(action_id=action.pk, operation="undo")
        assert undos.count() <= 1, f"{action.resource_identifier} undone twice"
        applied = AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk)
        assert applied.count() <= 1


@pytest.mark.parametrize(
    "point", ["after_barrier_commit", "plan_advance_before_commit", "after_undo_job"]
)
def test_a_worker_killed_at_each_point_of_a_compensating_plan_applies_nothing_twice(
    api: Any, run: Any, operator: Any, world: Any, rq_worker: Any, point: str
) -> None:
    """Three steps apply, the fourth is stale (the agent's to retry): the plan
    compensates three steps. A worker that SIGKILLs itself at `point` is started
    again and again (each dies at the next time it reaches the point) until the plan
    ends; then every write and every undo happened at most once and the plan ends
    `compensated` with every resource back where it was."""
    from approvals.services.reconcile import reconcile

    make_resource("dns-record/app-c", {"ip": "c"}, version=5)
    steps = [
        _patch("dns-record/app-a", '"3"', {"ip": "2"}),
        _create("dns-record/app-new", {"ip": "9"}),
        _patch(POLICY, '"41"', {"x": 1}),
        _put("dns-record/app-c", '"5"', {"ip": "c2"}),
    ]
    plan_id = _proposed(api, run, steps)
    _bump("dns-record/app-c", {"ip": "someone"})
    _approve(api, operator, plan_id)

    crashes = 0
    for _ in range(10):
        worker = rq_worker(AIRLOCK_TEST_CRASH_AT=point)
        try:
            wait_for(
                lambda worker=worker: not worker.alive() or _status(plan_id) == "compensated",
                timeout=20,
            )
        except AssertionError:
            break  # this worker no longer reaches the point
        if _status(plan_id) == "compensated":
            break
        crashes += 1
        reconcile()
    assert crashes >= 1, f"the worker never reached {point}"
    print(f"{point}: the worker was killed {crashes} times")
    survivor = rq_worker()

    def reconciled_to_the_end() -> bool:
        reconcile()
        return _status(plan_id) == "compensated"

    wait_for(reconciled_to_the_end, timeout=60, interval=0.5)
    _applied_at_most_once(run.run.pk)
    assert _document("dns-record/app-a").document == {"ip": "1"}
    assert _document("dns-record/app-new").deleted
    assert _document(POLICY).document == {"channels": ["email"]}, survivor.output()
    assert _document("dns-record/app-c").document == {"ip": "someone"}
    ended = AuditEvent.objects.filter(event_type="plan.ended", details__plan=plan_id)
    assert ended.count() == 1


# --- The plan's approval, its reads and its key ---------------------------------------


def test_a_plan_needs_the_strictest_quorum_and_keeps_the_agents_owner_out(
    api: Any, run: Any, operator: Any, world: Any
) -> None:
    from approvals.models import Approval
    from ownership.models import ConflictClass
    from tests.fixtures.api import make_person_with_token

    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    owner = make_person_with_token("agent-owner", "operators")
    run.agent.owner = owner.user
    run.agent.save(update_fields=["owner"])
    second = make_person_with_token("second-operator", "operators")
    response = _propose(api, run, _three_steps())
    assert response.status_code == 202, response.content
    plan_id = response.json()["id"]
    approval = Approval.objects.get(plan_id=plan_id)
    assert approval.quorum == 2 and approval.subject == "plan"
    item = next(
        i
        for i in api.get("/api/v1/approvals?status=pending", token=operator.token).json()["items"]
        if i.get("plan") == plan_id
    )
    assert [s["resource"] for s in item["steps"]] == [
        "dns-record/app-a",
        "dns-record/app-new",
        POLICY,
    ]
    assert item["steps"][2]["diff"] == [
        {"path": "/channels", "current": ["email"], "proposed": ["pager"]}
    ]
    assert item["quorum"] == 2

    url = f"/api/v1/approvals/{approval.pk}/decision"
    refused = api.post(url, token=owner.token, body={"decision": "approve"})
    assert refused.status_code == 403 and refused.json()["code"] == "self_approval"
    assert api.post(url, token=operator.token, body={"decision": "approve"}).status_code == 200
    assert _status(plan_id) == "pending_approval"  # one of two
    assert api.post(url, token=second.token, body={"decision": "approve"}).status_code == 200
    assert _status(plan_id) == "executing"


def test_a_rejected_plan_runs_nothing_and_the_agent_reads_why(
    api: Any, run: Any, operator: Any, world: Any
) -> None:
    response = _propose(api, run, _three_steps())
    plan_id = response.json()["id"]
    [item] = [
        i
        for i in api.get("/api/v1/approvals?status=pending", token=operator.token).json()["items"]
        if i.get("plan") == plan_id
    ]
    rejected = api.decide(
        item["id"], "reject", token=operator.token, comment="not during the freeze"
    )
    assert rejected.status_code == 200, rejected.content
    body = _plan(api, run.token, plan_id)
    assert body["status"] == "rejected"
    assert body["error"]["comment"] == "not during the freeze"
    assert [s["status"] for s in body["steps"]] == ["skipped"] * 3
    assert Action.objects.filter(run=run.run).count() == 0


def test_the_plan_answers_304_to_its_etag_and_a_replayed_key_gets_the_same_plan(
    api: Any, run: Any, world: Any
) -> None:
    key = _key()
    body = {"reason": "r", "steps": _three_steps()}
    path = f"/api/v1/runs/{run.run.pk}/plans"
    first = api.post(path, token=run.token, body=body, headers={"Idempotency-Key": key})
    assert first.status_code == 202, first.content
    again = api.post(path, token=run.token, body=body, headers={"Idempotency-Key": key})
    assert again.status_code == 202 and again["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert Plan.objects.count() == 1
    other = api.post(
        path, token=run.token, body={**body, "reason": "x"}, headers={"Idempotency-Key": key}
    )
    assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused"
    assert Plan.objects.count() == 1
    missing = api.post(path, token=run.token, body=body)
    assert missing.status_code == 400 and missing.json()["code"] == "idempotency_key_missing"

    plan_url = f"/api/v1/plans/{first.json()['id']}"
    etag = api.get(plan_url, token=run.token)["ETag"]
    unchanged = api.get(plan_url, token=run.token, headers={"If-None-Match": etag})
    assert unchanged.status_code == 304
    elsewhere = api.post(
        f"/api/v1/runs/{uuid.uuid4()}/plans",
        token=run.token,
        body=body,
        headers={"Idempotency-Key": _key()},
    )
    assert elsewhere.status_code == 404


def test_a_kill_switch_pauses_a_step_and_the_release_resumes_the_plan_where_it_stopped(
    api: Any, run: Any, world: Any, rq_worker: Any
) -> None:
    from audit.services import Actor
    from console.services import kill_switch_set

    rq_worker()
    actor = Actor.system("test")
    kill_switch_set(scope="dns-record/app-b", engaged=True, reason="incident", actor=actor)
    steps = [
        _patch("dns-record/app-a", '"3"', {"ip": "2"}),
        _create("dns-record/app-b", {"b": 1}),
    ]
    plan_id = _propose(api, run, steps).json()["id"]
    wait_for(
        lambda: (a := _step_action(plan_id, 2)) is not None and a.status == "paused", timeout=30
    )
    assert _document("dns-record/app-a").document == {"ip": "2"}
    assert _status(plan_id) == "executing"
    kill_switch_set(scope="dns-record/app-b", engaged=False, reason="", actor=actor)
    wait_for(lambda: _status(plan_id) == "applied", timeout=30)
    assert _document("dns-record/app-b").document == {"b": 1}
    assert ResourceVersion.objects.filter(resource=_document("dns-record/app-a")).count() == 2


def test_a_run_that_ends_cancels_its_waiting_plan_and_compensates_its_running_one(
    api: Any, run: Any, operator: Any, world: Any, rq_worker: Any
) -> None:
    from approvals.services.runs import run_finish
    from audit.services import Actor
    from console.services import kill_switch_set

    waiting_id = _propose(api, run, _three_steps()).json()["id"]  # per-call: waits
    rq_worker()
    kill_switch_set(
        scope="dns-record/app-b", engaged=True, reason="hold", actor=Actor.system("test")
    )
    running = _propose(
        api,
        run,
        [
            _create("dns-record/app-c", {"c": 1}),
            _create("dns-record/app-b", {"b": 1}),
        ],
    )
    running_id = running.json()["id"]
    wait_for(lambda: (a := _step_action(running_id, 2)) is not None and a.status == "paused")
    run_finish(run=run.run, actor=Actor.run(run.run))

    assert _status(waiting_id) == "cancelled"
    assert _plan(api, run.token, waiting_id)["error"]["code"] == "run_not_active"
    wait_for(lambda: _status(running_id) == "compensated", timeout=30)
    assert _document("dns-record/app-c").deleted
    assert not Resource.objects.filter(kind_id="dns-record", name="app-b").exists()


def test_a_plan_whose_approval_expires_ends_expired_with_nothing_run(
    api: Any, run: Any, world: Any
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from approvals.models import Approval
    from approvals.services.decisions import approval_expire_due

    plan_id = _propose(api, run, _three_steps()).json()["id"]
    Approval.objects.filter(plan_id=plan_id).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert approval_expire_due()["expired"] == 1
    body = _plan(api, run.token, plan_id)
    assert body["status"] == "expired" and body["error"]["code"] == "approval_expired"
    assert [s["status"] for s in body["steps"]] == ["skipped"] * 3
    assert AuditEvent.objects.filter(event_type="approval.expired", details__plan=plan_id).exists()
    assert Action.objects.filter(run=run.run).count() == 0


def test_a_long_poll_on_a_plan_is_answered_when_its_approval_is_decided(
    api_server: Any, run: Any, operator: Any, world: Any
) -> None:
    """On a real uvicorn server: the agent holds `GET /plans/{id}` (If-None-Match,
    Prefer: wait) and is answered with `executing` once the operator approves."""
    import httpx

    # reason: a module of slow tests; only this test needs its long-poll helper
    from tests.test_api_longpoll import HeldPoll

    base = api_server.url
    agent_headers = {"Authorization": f"Bearer {run.token}"}
    proposed = httpx.post(
        f"{base}/api/v1/runs/{run.run.pk}/plans",
        headers={**agent_headers, "Idempotency-Key": _key()},
        json={"steps": _three_steps()},
        timeout=10,
    )
    assert proposed.status_code == 202, proposed.text
    poll = HeldPoll(
        base, f"{base}{proposed.headers['Location']}", agent_headers, proposed.headers["ETag"]
    )
    person = {"Authorization": f"Bearer {operator.token}"}
    items = httpx.get(f"{base}/api/v1/approvals?status=pending", headers=person, timeout=10)
    [item] = [i for i in items.json()["items"] if i["plan"] == proposed.json()["id"]]
    decided = httpx.post(
        f"{base}/api/v1/approvals/{item['id']}/decision",
        headers=person,
        json={"decision": "approve"},
        timeout=10,
    )
    assert decided.status_code == 200, decided.text
    poll.woken("executing")


def test_an_overdue_plan_approval_escalates_to_its_steps_escalation_group(
    api: Any, run: Any, world: Any
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from approvals.models import Approval
    from approvals.services.decisions import approval_expire_due
    from ownership.models import ConflictClass
    from tests.fixtures.api import make_person_with_token

    ConflictClass.objects.filter(slug="replace_shared_document").update(
        escalation_seconds=60, escalation_group="oncall"
    )
    oncall = make_person_with_token("pager-holder", "oncall")
    plan_id = _propose(api, run, _three_steps()).json()["id"]
    approval = Approval.objects.get(plan_id=plan_id)
    assert approval.escalate_at is not None

    def listed() -> list[Any]:
        items = api.get("/api/v1/approvals?status=pending", token=oncall.token).json()["items"]
        return [i["plan"] for i in items]

    assert listed() == []
    Approval.objects.filter(pk=approval.pk).update(
        escalate_at=timezone.now() - timedelta(seconds=1)
    )
    assert approval_expire_due()["escalated"] == 1
    assert listed() == [plan_id]
    escalated = AuditEvent.objects.get(event_type="approval.escalated")
    assert escalated.details["escalation_group"] == "oncall"


def test_who_reads_a_plan(
    api: Any, run: Any, operator: Any, owner: Any, outsider: Any, world: Any
) -> None:
    from tests.fixtures.api import make_active_run, make_agent_with_token

    plan_id = _propose(api, run, _three_steps()).json()["id"]
    url = f"/api/v1/plans/{plan_id}"
    assert api.get(url, token=run.token).status_code == 200  # its run
    assert api.get(url, token=operator.token).status_code == 200  # operators read everything
    assert api.get(url, token=owner.token).status_code == 200  # owns what step 1 will write
    assert api.get(url, token=outsider.token).status_code == 404
    stranger = make_active_run(
        make_agent_with_token("stranger-bot").agent,
        [{"resource": "dns-record/elsewhere", "operations": ["update"]}],
    )
    assert api.get(url, token=stranger.token).status_code == 404  # another agent's run
    assert api.get(f"/api/v1/plans/{uuid.uuid4()}", token=run.token).status_code == 404


# A run's end and a plan approval's decision end a waiting plan by one rule
# (approvals/services/plan_state.py): nothing ran, every step skipped, and the plan's ETag
# and updated_at move, so a reader holding the old ETag is not told 304.
def _propose_waiting_plan(api: Any, run: Any) -> str:
    make_resource(POLICY, {"channels": ["email"]}, version=41)
    response = _propose(api, run, [_patch(POLICY, '"41"', {"channels": ["pager"]})])
    assert response.status_code in (201, 202), response.content
    plan_id = str(response.json()["id"])
    assert Plan.objects.get(pk=plan_id).status == "pending_approval"
    return plan_id


def test_a_revoked_run_cancels_its_waiting_plan_and_moves_its_etag(api: Any, run: Any) -> None:
    plan_id = _propose_waiting_plan(api, run)
    before = Plan.objects.get(pk=plan_id)
    etag = api.get(f"/api/v1/plans/{plan_id}", token=run.token)["ETag"]

    run_revoke(run=run.run, actor=Actor.system("test"), reason="stop")

    after = Plan.objects.get(pk=plan_id)
    assert after.status == "cancelled"
    assert after.error == {"code": "run_not_active", "detail": "the run was revoked"}
    assert after.revision == before.revision + 1
    assert after.updated_at > before.updated_at
    assert after.ended_at is not None
    assert set(PlanStep.objects.filter(plan_id=plan_id).values_list("status", flat=True)) == {
        "skipped"
    }
    again = api.get(f"/api/v1/plans/{plan_id}", token=run.token, headers={"If-None-Match": etag})
    assert again.status_code == 200


def test_an_ended_run_leaves_a_plan_that_already_ended_alone(api: Any, run: Any) -> None:
    plan_id = _propose_waiting_plan(api, run)
    Plan.objects.filter(pk=plan_id).update(status="rejected")
    revision = Plan.objects.get(pk=plan_id).revision

    run_revoke(run=run.run, actor=Actor.system("test"), reason="stop")

    after = Plan.objects.get(pk=plan_id)
    assert after.status == "rejected" and after.revision == revision
