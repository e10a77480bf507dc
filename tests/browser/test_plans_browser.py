"""A plan in real Chromium: approved from its one inbox card, watched to `applied`.

The plan is proposed through the API with a run token; its steps are executed by a
real `rqworker` subprocess, so "applied" on the plan page means the barrier applied
every step, in order.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from playwright.sync_api import expect

from approvals.models import Approval, Plan
from ownership.models import Resource
from tests.browser.conftest import WatchedPages, check_accessibility, screenshot, sign_in
from tests.fixtures.console import PASSWORD, People
from tests.fixtures.core import make_resource

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

POLICY = "notification-policy/prod-alerts"


@pytest.mark.slow
def test_an_operator_approves_a_plan_in_the_inbox_and_watches_it_reach_applied(
    pages: WatchedPages, people: People, api: Any, run: Any, rq_worker: Any
) -> None:
    worker = rq_worker()
    make_resource("dns-record/app-a", {"ip": "1"}, version=3)
    make_resource(POLICY, {"channels": ["email"]}, version=41)
    proposed = api.post(
        f"/api/v1/runs/{run.run.pk}/plans",
        token=run.token,
        body={
            "reason": "move app-a and its alerts together",
            "steps": [
                {
                    "resource": "dns-record/app-a",
                    "method": "PATCH",
                    "if_match": '"3"',
                    "patch": {"ip": "2"},
                },
                {
                    "resource": "dns-record/app-new",
                    "method": "PUT",
                    "if_none_match": "*",
                    "document": {"ip": "9"},
                },
                {
                    "resource": POLICY,
                    "method": "PATCH",
                    "if_match": '"41"',
                    "patch": {"channels": ["pager"]},
                },
            ],
        },
        headers={"Idempotency-Key": f"plan-{uuid.uuid4().hex}"},
    )
    assert proposed.status_code == 202, proposed.content
    plan_id = proposed.json()["id"]
    approval = Approval.objects.get(plan_id=plan_id)

    page = pages.new()
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    card = page.locator(f"#approval-{approval.id}")
    expect(card).to_contain_text("Plan approval: 3 writes by deploy-bot, approved as one")
    expect(card.locator(".plan-step")).to_have_count(3)
    expect(card.locator(".diff")).to_have_count(3)
    expect(card.locator(".diff").nth(2)).to_contain_text("pager")
    assert check_accessibility(page, "inbox with a plan") == []
    screenshot(page, "plan-approval-card")

    card.get_by_label("Comment (required to reject)").fill("one change, three writes")
    card.get_by_role("button", name="Approve").click()
    expect(card).to_contain_text("Decided at")  # the card came back in place
    assert page.url.endswith("/approvals/")

    card.get_by_role("link", name=plan_id).click()
    page.wait_for_url(f"**/plans/{plan_id}/")
    status = page.locator("#plan-status")
    try:
        # The live part polls itself: no reload between "executing" and "applied".
        expect(status).to_have_attribute("data-status", "applied", timeout=30_000)
    except AssertionError:
        print(worker.output()[-4000:])
        raise
    steps = page.locator(".plan-step h3 .status")
    expect(steps).to_have_count(3)
    for n in range(3):
        expect(steps.nth(n)).to_have_attribute("data-status", "applied")
    expect(page.locator("#plan-live")).not_to_have_attribute("hx-get", f"/plans/{plan_id}/")
    expect(page.locator("#plan-live")).to_contain_text("one change, three writes")
    assert check_accessibility(page, "plan page") == []
    screenshot(page, "plan-applied")
    assert Plan.objects.get(pk=plan_id).status == "applied"
    assert Resource.objects.get(kind_id="dns-record", name="app-new").document == {"ip": "9"}
