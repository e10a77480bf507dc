"""A run's end and a plan approval's decision end a waiting plan by one rule
(approvals/services/plan_state.py): nothing ran, every step skipped, and the plan's
ETag and `updated_at` move, so a reader holding the old ETag is not told 304."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Plan, PlanStep
from approvals.services.runs import run_revoke
from audit.services import Actor
from tests.fixtures.core import make_resource
from tests.test_plans import POLICY, _patch, _propose

pytestmark = pytest.mark.django_db(transaction=True)


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
