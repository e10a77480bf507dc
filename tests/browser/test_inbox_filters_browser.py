"""The approvals inbox's filters in real Chromium (issue 43): choosing a filter narrows
the cards in place, the address carries it (a reload or a bookmark shows the same cards,
the back button returns to the previous choice with its cards and its form), and "Clear"
restores every card."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from approvals.models import Approval, ApprovalDecision
from tests.browser.conftest import WatchedPages, check_accessibility, sign_in
from tests.fixtures.api import ApiClient, make_agent_with_token
from tests.fixtures.console import PASSWORD, People, World
from tests.test_grants import _flags_run, _pending_approval

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _cards(page: Any) -> Any:
    return page.locator("#approval-items article.approval")


def _expect_cards(page: Any, *approvals: Approval) -> None:
    """Exactly these cards are shown (in any order)."""
    expect(_cards(page)).to_have_count(len(approvals))
    for approval in approvals:
        expect(page.locator(f"#approval-{approval.id}")).to_be_visible()


def test_filters_narrow_the_cards_are_bookmarkable_and_the_back_button_works(
    pages: WatchedPages, people: People, world: World
) -> None:
    flag = _pending_approval(
        ApiClient(), _flags_run(make_agent_with_token("flag-bot").agent), "team-a-one"
    )
    call, run = world.approval, world.run_approval
    # The call approval waits two hours for a second approver; olivia already approved it.
    Approval.objects.filter(pk=call.pk).update(
        created_at=timezone.now() - timedelta(hours=2), quorum=2
    )
    ApprovalDecision.objects.create(approval=call, person=people.operator, decision="approve")
    page = pages.new(width=1400, height=900)
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    _expect_cards(page, call, run, flag)

    # Agent: only flag-bot's card, the address says so.
    page.get_by_label("Agent", exact=True).select_option("flag-bot")
    page.wait_for_url("**/approvals/?agent=flag-bot")
    _expect_cards(page, flag)
    # Class on top of it: nothing matches, and the page says why.
    page.get_by_label("Class", exact=True).select_option("replace_shared_document")
    page.wait_for_url("**/approvals/?agent=flag-bot&class=replace_shared_document")
    expect(_cards(page)).to_have_count(0)
    expect(page.get_by_text("No approvals match these filters.")).to_be_visible()
    expect(page.get_by_text("Nothing is waiting for a decision.")).to_be_hidden()

    # Back: flag-bot's card again, the form showing that choice; back again: everything.
    page.go_back()
    page.wait_for_url("**/approvals/?agent=flag-bot")
    _expect_cards(page, flag)
    expect(page.get_by_label("Agent", exact=True)).to_have_value("flag-bot")
    expect(page.get_by_label("Class", exact=True)).to_have_value("")
    page.go_back()
    page.wait_for_url("**/approvals/")
    _expect_cards(page, call, run, flag)
    expect(page.get_by_label("Agent", exact=True)).to_have_value("")
    # Forward: the filtered cards and form once more.
    page.go_forward()
    page.wait_for_url("**/approvals/?agent=flag-bot")
    _expect_cards(page, flag)
    expect(page.get_by_label("Agent", exact=True)).to_have_value("flag-bot")

    # A bookmark of a filtered inbox: resource prefix typed, then Enter.
    page.get_by_label("Agent", exact=True).select_option("")
    page.wait_for_url("**/approvals/")
    _expect_cards(page, call, run, flag)
    page.get_by_label("Resource starts with").fill("notification-policy/prod")
    page.get_by_label("Resource starts with").press("Enter")
    page.wait_for_url("**/approvals/?resource=notification-policy%2Fprod")
    _expect_cards(page, call)
    bookmark = page.url
    other = pages.new(width=390, height=844)
    sign_in(other, "olivia", PASSWORD)
    other.goto(bookmark)
    _expect_cards(other, call)
    expect(other.get_by_label("Resource starts with")).to_have_value("notification-policy/prod")
    assert not check_accessibility(other, "inbox-filtered-narrow")

    # Age and "waiting for me".
    page.goto("/approvals/")
    page.get_by_label("Age", exact=True).select_option("1h")
    page.wait_for_url("**/approvals/?age=1h")
    _expect_cards(page, call)
    page.get_by_label("Age", exact=True).select_option("")
    page.wait_for_url("**/approvals/")
    page.get_by_label("Waiting for me").check()
    page.wait_for_url("**/approvals/?mine=1")
    _expect_cards(page, run, flag)
    assert not check_accessibility(page, "inbox-filtered-wide")

    # Clear: every card, and a form that filters nothing.
    page.get_by_role("link", name="Clear").click()
    page.wait_for_url("**/approvals/")
    _expect_cards(page, call, run, flag)
    expect(page.get_by_label("Waiting for me")).not_to_be_checked()
