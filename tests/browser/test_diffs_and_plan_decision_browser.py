"""Real Chromium at a desktop (1400x900) and a phone (390x844): the plan page's own
approval (in place, no reload, the comment surviving the page's poll), the diff toggle
(details/summary: the field list or both whole documents), the conflict page's marks and
a resolved conflict's "what was kept"; axe-core clean and nothing wider than the screen."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from playwright.sync_api import expect

from approvals.models import Approval, Plan
from tests.browser.conftest import WatchedPages, check_accessibility, screenshot, sign_in
from tests.fixtures.console import PASSWORD, People, World
from tests.fixtures.core import make_resource

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SIZES = {"phone": (390, 844), "desktop": (1400, 900)}
POLICY = "notification-policy/prod-alerts"


def _fits(page: Any, width: int) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= width


@pytest.mark.parametrize("size", sorted(SIZES))
def test_a_plan_is_approved_on_its_own_page_in_place(
    pages: WatchedPages, people: People, api: Any, run: Any, size: str
) -> None:
    width, height = SIZES[size]
    make_resource(POLICY, {"channels": ["email", "sms"]}, version=41)
    proposed = api.post(
        f"/api/v1/runs/{run.run.pk}/plans",
        token=run.token,
        body={
            "reason": "add the pager",
            "steps": [
                {
                    "resource": POLICY,
                    "method": "PATCH",
                    "if_match": '"41"',
                    "patch": {"channels": ["email", "pager", "sms"]},
                }
            ],
        },
        headers={"Idempotency-Key": f"plan-{uuid.uuid4().hex}"},
    )
    assert proposed.status_code == 202, proposed.content
    plan_id = proposed.json()["id"]
    approval = Approval.objects.get(plan_id=plan_id)
    if approval.status != "pending":
        pytest.skip("this class needs no approval for the plan")

    page = pages.new(width=width, height=height)
    sign_in(page, "olivia", PASSWORD)
    page.goto(f"/plans/{plan_id}/")
    step = page.locator(".plan-step").first
    # One added channel is one added element, marked in text as well as colour.
    added = step.locator(".diff-elements li.el-added").first
    expect(added).to_contain_text("pager")
    expect(added.locator(".visually-hidden")).to_have_text("added: ")
    expect(step.locator(".diff-elements li.el-same")).to_have_count(2)
    # The toggle: both whole documents instead of the field list, without a reload.
    page.evaluate("window.__noReload = true")
    field_list = step.locator("ul.diff").first
    expect(field_list).to_be_visible()
    step.locator("summary", has_text="Whole document, side by side").first.click()
    expect(step.locator("table.side-by-side").first).to_be_visible()
    expect(field_list).to_be_hidden()
    expect(step.locator("table.side-by-side td.line-added").first).to_contain_text("pager")
    _fits(page, width)
    assert check_accessibility(page, f"{size} plan page, pending") == []
    screenshot(page, f"plan-decide-{size}")

    page.get_by_label("Comment (required to reject)").fill("pager is fine")
    page.wait_for_timeout(2200)  # two of the page's own polls
    expect(page.get_by_label("Comment (required to reject)")).to_have_value("pager is fine")
    page.get_by_role("button", name="Approve the plan").click()
    expect(page.locator("#plan-my-decision")).to_contain_text("You approved this plan")
    expect(page.locator("#plan-decision-form")).to_have_count(0)
    assert page.evaluate("window.__noReload") is True  # swapped in place
    assert Approval.objects.get(pk=approval.pk).status == "approved"
    assert Plan.objects.get(pk=plan_id).status != "pending_approval"
    expect(page.locator("#plan-live")).to_contain_text("pager is fine")
    _fits(page, width)
    assert check_accessibility(page, f"{size} plan page, approved") == []


@pytest.mark.parametrize("size", sorted(SIZES))
def test_the_conflict_page_marks_sides_and_shows_what_a_resolution_kept(
    pages: WatchedPages, people: People, world: World, size: str
) -> None:
    width, height = SIZES[size]
    page = pages.new(width=width, height=height)
    sign_in(page, "rita", PASSWORD)
    page.goto(f"/conflicts/{world.conflict.id}/")
    proposed = page.locator('td[data-side="proposed"] .diff-elements li.el-added')
    expect(proposed).to_contain_text("sms")
    page.locator("#whole-documents summary").click()
    expect(page.locator("#whole-documents table.side-by-side")).to_be_visible()
    _fits(page, width)
    assert check_accessibility(page, f"{size} conflict page, open") == []
    screenshot(page, f"conflict-diff-{size}")

    page.get_by_role("button", name="Resolve").click()
    expect(page.locator(".kept-fields")).to_contain_text("/channels")
    expect(page.locator("#result-document")).to_contain_text("sms")
    _fits(page, width)
    assert check_accessibility(page, f"{size} conflict page, resolved") == []
