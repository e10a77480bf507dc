"""Plans (issue 13), their lifecycle: a worker killed at every point of a compensating
plan, the plan's approval (quorum, rejection, expiry, escalation), its reads (ETag, key,
long-poll, who reads) and the end of its run. Real PostgreSQL, a private Redis and `rqworker`
processes; the resources and write set as in tests/test_plans.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from approvals.models import Action, Plan, PlanStep
from approvals.services.runs import run_revoke
from audit.models import AuditEvent
from audit.services import Actor
from ownership.models import Resource, ResourceVersion
from tests.fixtures import plans as plan_fx
from tests.fixtures.core import make_resource
from tests.fixtures.engine import WORKER_LOCK_TTL_MS, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

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
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any, settings: Any, point: str
) -> None:
    """Three steps apply, the fourth is stale (the agent's to retry): the plan
    compensates three steps. A worker that SIGKILLs itself at `point` is started
    again and again (each dies at the next time it reaches the point) until the plan
    ends; then every write and every undo happened at most once and the plan ends
    `compensated` with every resource back where it was."""
    from approvals.services.reconcile import reconcile

    # The reconciler below runs in this process: one deployment, one lock TTL (rq_worker's),
    # so that it judges the workers' leases by the TTL they were taken with.
    settings.AIRLOCK_LOCK_TTL_MS = WORKER_LOCK_TTL_MS
    make_resource("dns-record/app-c", {"ip": "c"}, version=5)
    steps = [
        plan_fx.patch_step("dns-record/app-a", '"3"', {"ip": "2"}),
        plan_fx.create_step("dns-record/app-new", {"ip": "9"}),
        plan_fx.patch_step(plan_fx.POLICY, '"41"', {"x": 1}),
        plan_fx.put_step("dns-record/app-c", '"5"', {"ip": "c2"}),
    ]
    plan_id = plan_fx.proposed_plan(api, run, steps)
    plan_fx.bump_resource("dns-record/app-c", {"ip": "someone"})
    plan_fx.approve_plan(api, operator, plan_id)

    crashes = 0
    for _ in range(10):
        worker = rq_worker(AIRLOCK_TEST_CRASH_AT=point)
        try:
            wait_for(
                lambda worker=worker: (
                    not worker.alive() or plan_fx.plan_status(plan_id) == "compensated"
                ),
                # Once it has crashed, a worker that goes on for several lock TTLs without
                # reaching the point is waiting for the reconciler below (a lease to expire).
                timeout=20 if crashes == 0 else 8,
            )
        except AssertionError:
            break  # this worker no longer reaches the point
        if plan_fx.plan_status(plan_id) == "compensated":
            break
        crashes += 1
        reconcile()
    assert crashes >= 1, f"the worker never reached {point}"
    print(f"{point}: the worker was killed {crashes} times")
    survivor = rq_worker()

    def reconciled_to_the_end() -> bool:
        reconcile()
        return plan_fx.plan_status(plan_id) == "compensated"

    wait_for(reconciled_to_the_end, timeout=60, interval=0.5)
    _applied_at_most_once(run.run.pk)
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "1"}
    assert plan_fx.resource_row("dns-record/app-new").deleted
    assert plan_fx.resource_row(plan_fx.POLICY).document == {"channels": ["email"]}, (
        survivor.output()
    )
    assert plan_fx.resource_row("dns-record/app-c").document == {"ip": "someone"}
    ended = AuditEvent.objects.filter(event_type="plan.ended", details__plan=plan_id)
    assert ended.count() == 1


# --- The plan's approval, its reads and its key ---------------------------------------


def test_a_plan_needs_the_strictest_quorum_and_keeps_the_agents_owner_out(
    api: Any, run: Any, operator: Any, plan_world: Any
) -> None:
    from approvals.models import Approval
    from ownership.models import ConflictClass
    from tests.fixtures.api import make_person_with_token

    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    owner = make_person_with_token("agent-owner", "operators")
    run.agent.owner = owner.user
    run.agent.save(update_fields=["owner"])
    second = make_person_with_token("second-operator", "operators")
    response = plan_fx.propose_plan(api, run, plan_fx.three_steps())
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
        plan_fx.POLICY,
    ]
    assert item["steps"][2]["diff"] == [
        {"path": "/channels", "current": ["email"], "proposed": ["pager"]}
    ]
    assert item["quorum"] == 2

    url = f"/api/v1/approvals/{approval.pk}/decision"
    refused = api.post(url, token=owner.token, body={"decision": "approve"})
    assert refused.status_code == 403 and refused.json()["code"] == "self_approval"
    assert api.post(url, token=operator.token, body={"decision": "approve"}).status_code == 200
    assert plan_fx.plan_status(plan_id) == "pending_approval"  # one of two
    assert api.post(url, token=second.token, body={"decision": "approve"}).status_code == 200
    assert plan_fx.plan_status(plan_id) == "executing"


def test_a_rejected_plan_runs_nothing_and_the_agent_reads_why(
    api: Any, run: Any, operator: Any, plan_world: Any
) -> None:
    response = plan_fx.propose_plan(api, run, plan_fx.three_steps())
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
    body = plan_fx.read_plan(api, run.token, plan_id)
    assert body["status"] == "rejected"
    assert body["error"]["comment"] == "not during the freeze"
    assert [s["status"] for s in body["steps"]] == ["skipped"] * 3
    assert Action.objects.filter(run=run.run).count() == 0


def test_the_plan_answers_304_to_its_etag_and_a_replayed_key_gets_the_same_plan(
    api: Any, run: Any, plan_world: Any
) -> None:
    key = plan_fx.plan_key()
    body = {"reason": "r", "steps": plan_fx.three_steps()}
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
        headers={"Idempotency-Key": plan_fx.plan_key()},
    )
    assert elsewhere.status_code == 404


def test_a_kill_switch_pauses_a_step_and_the_release_resumes_the_plan_where_it_stopped(
    api: Any, run: Any, plan_world: Any, rq_worker: Any
) -> None:
    from audit.services import Actor
    from console.services import kill_switch_set

    rq_worker()
    actor = Actor.system("test")
    kill_switch_set(scope="dns-record/app-b", engaged=True, reason="incident", actor=actor)
    steps = [
        plan_fx.patch_step("dns-record/app-a", '"3"', {"ip": "2"}),
        plan_fx.create_step("dns-record/app-b", {"b": 1}),
    ]
    plan_id = plan_fx.propose_plan(api, run, steps).json()["id"]
    wait_for(
        lambda: (a := plan_fx.step_action(plan_id, 2)) is not None and a.status == "paused",
        timeout=30,
    )
    assert plan_fx.resource_row("dns-record/app-a").document == {"ip": "2"}
    assert plan_fx.plan_status(plan_id) == "executing"
    kill_switch_set(scope="dns-record/app-b", engaged=False, reason="", actor=actor)
    wait_for(lambda: plan_fx.plan_status(plan_id) == "applied", timeout=30)
    assert plan_fx.resource_row("dns-record/app-b").document == {"b": 1}
    assert (
        ResourceVersion.objects.filter(resource=plan_fx.resource_row("dns-record/app-a")).count()
        == 2
    )


def test_a_run_that_ends_cancels_its_waiting_plan_and_compensates_its_running_one(
    api: Any, run: Any, operator: Any, plan_world: Any, rq_worker: Any
) -> None:
    from approvals.services.runs import run_finish
    from audit.services import Actor
    from console.services import kill_switch_set

    waiting_id = plan_fx.propose_plan(api, run, plan_fx.three_steps()).json()[
        "id"
    ]  # per-call: waits
    rq_worker()
    kill_switch_set(
        scope="dns-record/app-b", engaged=True, reason="hold", actor=Actor.system("test")
    )
    running = plan_fx.propose_plan(
        api,
        run,
        [
            plan_fx.create_step("dns-record/app-c", {"c": 1}),
            plan_fx.create_step("dns-record/app-b", {"b": 1}),
        ],
    )
    running_id = running.json()["id"]
    wait_for(lambda: (a := plan_fx.step_action(running_id, 2)) is not None and a.status == "paused")
    run_finish(run=run.run, actor=Actor.run(run.run))

    assert plan_fx.plan_status(waiting_id) == "cancelled"
    assert plan_fx.read_plan(api, run.token, waiting_id)["error"]["code"] == "run_not_active"
    wait_for(lambda: plan_fx.plan_status(running_id) == "compensated", timeout=30)
    assert plan_fx.resource_row("dns-record/app-c").deleted
    assert not Resource.objects.filter(kind_id="dns-record", name="app-b").exists()


def test_a_plan_whose_approval_expires_ends_expired_with_nothing_run(
    api: Any, run: Any, plan_world: Any
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from approvals.models import Approval
    from approvals.services.decisions import approval_expire_due

    plan_id = plan_fx.propose_plan(api, run, plan_fx.three_steps()).json()["id"]
    Approval.objects.filter(plan_id=plan_id).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert approval_expire_due()["expired"] == 1
    body = plan_fx.read_plan(api, run.token, plan_id)
    assert body["status"] == "expired" and body["error"]["code"] == "approval_expired"
    assert [s["status"] for s in body["steps"]] == ["skipped"] * 3
    assert AuditEvent.objects.filter(event_type="approval.expired", details__plan=plan_id).exists()
    assert Action.objects.filter(run=run.run).count() == 0


def test_a_long_poll_on_a_plan_is_answered_when_its_approval_is_decided(
    api_server: Any, run: Any, operator: Any, plan_world: Any
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
        headers={**agent_headers, "Idempotency-Key": plan_fx.plan_key()},
        json={"steps": plan_fx.three_steps()},
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
    api: Any, run: Any, plan_world: Any
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
    plan_id = plan_fx.propose_plan(api, run, plan_fx.three_steps()).json()["id"]
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
    api: Any, run: Any, operator: Any, owner: Any, outsider: Any, plan_world: Any
) -> None:
    from tests.fixtures.api import make_active_run, make_agent_with_token

    plan_id = plan_fx.propose_plan(api, run, plan_fx.three_steps()).json()["id"]
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
    make_resource(plan_fx.POLICY, {"channels": ["email"]}, version=41)
    response = plan_fx.propose_plan(
        api, run, [plan_fx.patch_step(plan_fx.POLICY, '"41"', {"channels": ["pager"]})]
    )
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
