"""The console read at a glance, in real Chromium (issue 43): the tab title carries
the count of what waits for me, relative times keep current, whole rows open their
item (mouse and keyboard), and the pages stay axe-clean at a phone's and a desktop's size.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

from approvals.selectors import pending_approval_count
from ownership.selectors import open_conflict_count
from tests.browser.conftest import WatchedPages, check_accessibility, sign_in
from tests.fixtures.console import PASSWORD, People, World

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_tab_title_counts_what_waits_for_me(
    pages: WatchedPages, people: People, world: World
) -> None:
    waiting = pending_approval_count(people.operator) + open_conflict_count(people.operator)
    assert waiting > 0
    page = pages.new()
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    expect(page).to_have_title(f"({waiting}) Approvals · Airlock")
    # Deciding elsewhere lowers the count on the next refresh of the badges.
    world.approval.status = "expired"
    world.approval.save(update_fields=["status"])
    page.evaluate("htmx.trigger(document.body, 'counts-changed')")
    expect(page).to_have_title(re.compile(rf"^(\({waiting - 1}\) )?Approvals · Airlock$"))


def test_a_refresh_asked_for_while_a_badge_is_swapped_in_is_not_lost(
    pages: WatchedPages, people: People, world: World
) -> None:
    """The collision behind an earlier flaky CI run: counts-changed fired while a badge's
    answer was being swapped in. Here the first refresh is answered with the count as it
    was (2) and, in the same step, the approval is decided; the page asks again from the
    swap's own afterSwap event, the tightest moment. The second answer must land."""
    waiting = pending_approval_count(people.operator) + open_conflict_count(people.operator)
    page = pages.new()
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    expect(page).to_have_title(f"({waiting}) Approvals · Airlock")
    answered: list[str] = []

    def first_answer_stale_then_decide(route: Any) -> None:
        if answered:
            route.continue_()
            return
        stale = route.fetch()
        world.approval.status = "expired"
        world.approval.save(update_fields=["status"])
        answered.append("stale")
        route.fulfill(response=stale)

    page.route("**/nav/counts/approvals/", first_answer_stale_then_decide)
    page.evaluate(
        """() => {
          let asked = false;
          document.body.addEventListener("htmx:afterSwap", (event) => {
            if (!asked && event.target.id === "nav-count-approvals") {
              asked = true;
              htmx.trigger(document.body, "counts-changed");
            }
          });
          htmx.trigger(document.body, "counts-changed");
        }"""
    )
    expect(page).to_have_title(re.compile(rf"^(\({waiting - 1}\) )?Approvals · Airlock$"))
    assert answered == ["stale"]


BURST = "() => { for (let i = 0; i < 3; i++) htmx.trigger(document.body, 'counts-changed'); }"


def test_refreshes_asked_for_in_a_burst_abort_nothing_and_the_last_lands(
    pages: WatchedPages, people: People, world: World
) -> None:
    """Three counts-changed in one tick while the first refresh is in flight: with
    hx-sync replace each newer one aborted the older request, and htmx logs an aborted
    request as a console error (the CI failure of stop 48). Queued instead, nothing is
    aborted (the page watcher fails the test on any console error) and the count
    decided in the meantime still shows."""
    waiting = pending_approval_count(people.operator) + open_conflict_count(people.operator)
    for path in ("/approvals/", "/"):
        page = pages.new()
        sign_in(page, "olivia", PASSWORD)
        page.goto(path)
        expect(page).to_have_title(re.compile(rf"^\({waiting}\) "))
        page.evaluate(BURST)
        page.wait_for_timeout(300)
    world.approval.status = "expired"
    world.approval.save(update_fields=["status"])
    page.evaluate(BURST)
    expect(page).to_have_title(re.compile(rf"^(\({waiting - 1}\) )?Dashboard · Airlock$"))
    expect(page.locator("#count-pending")).to_have_text(
        str(pending_approval_count(people.operator))
    )


def test_relative_times_keep_current(pages: WatchedPages, people: People, world: World) -> None:
    page = pages.new()
    sign_in(page, "olivia", PASSWORD)
    page.goto(f"/runs/{world.run.pk}/")
    created = page.locator("dd [data-relative]").first
    expect(created).to_have_text(re.compile(r"^(just now|\d+ min ago)$"))
    # Pretend the page has been open for two hours: the next tick rewrites the words.
    page.evaluate("() => { const real = Date.now; Date.now = () => real() + 2 * 3600 * 1000; }")
    expect(created).to_have_text(re.compile(r"^2 h( \d+ min)? ago$"), timeout=3000)


@pytest.mark.parametrize("size", [(390, 844), (1400, 900)])
def test_the_pages_touched_stay_axe_clean(
    pages: WatchedPages, people: People, world: World, size: tuple[int, int]
) -> None:
    page = pages.new(width=size[0], height=size[1])
    sign_in(page, "olivia", PASSWORD)
    problems: list[dict[str, Any]] = []
    paths = [
        "/",
        "/catalog/",
        "/conflicts/?scope=all",
        "/audit/",
        "/search/?q=prod",
        f"/runs/{world.run.pk}/",
        f"/conflicts/{world.conflict.id}/",
    ]
    for path in paths:
        page.goto(path)
        problems += check_accessibility(page, f"{size} {path}")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= size[0], (path, width)
    assert not problems, problems


def _audit_on_the_conflict_action(world: World) -> None:
    world.audit("test.row_click", action=world.conflict_action, details={"n": 1})


@pytest.mark.parametrize("size", [(390, 844), (1400, 900)])
def test_a_click_anywhere_on_a_row_opens_its_item(
    pages: WatchedPages, people: People, world: World, size: tuple[int, int]
) -> None:
    _audit_on_the_conflict_action(world)
    page = pages.new(width=size[0], height=size[1])
    sign_in(page, "olivia", PASSWORD)
    # (list, a cell that is not the link, where the row leads)
    rows = [
        (
            "/runs/",
            f"#run-list tr:has(a[href='/runs/{world.run.pk}/']) td:nth-child(3)",
            f"/runs/{world.run.pk}/",
        ),
        (
            "/resources/",
            "#resource-list tbody tr:first-child td:nth-child(3)",
            f"/resources/{world.resource.identifier}/",
        ),
        (
            "/conflicts/?scope=all",
            f"#conflict-list tr:has(a[href='/conflicts/{world.conflict.id}/']) td:nth-child(3)",
            f"/conflicts/{world.conflict.id}/",
        ),
        (
            "/audit/",
            "tr:has(code:text('test.row_click')) td:nth-child(3)",
            f"/actions/{world.conflict_action.pk}/",
        ),
    ]
    for listing, cell, target in rows:
        page.goto(listing)
        # A real mouse click at the cell's centre (the row link's overlay receives it;
        # Playwright's own click would refuse, seeing the overlay cover the cell).
        page.locator(cell).first.scroll_into_view_if_needed()
        box = page.locator(cell).first.bounding_box()
        assert box is not None, cell
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_url(f"**{target}")
    # Another link in the row still leads to its own page, not the row's.
    page.goto("/audit/")
    row = page.locator("tr:has(code:text('test.row_click'))").first
    row.get_by_role("link", name=world.resource.identifier).click()
    page.wait_for_url(f"**/resources/{world.resource.identifier}/")


def test_the_row_link_is_reached_and_followed_by_keyboard(
    pages: WatchedPages, people: People, world: World
) -> None:
    page = pages.new()
    sign_in(page, "olivia", PASSWORD)
    page.goto("/conflicts/?scope=all")
    link = page.locator(f"a.row-link[href='/conflicts/{world.conflict.id}/']")
    page.locator("main h1").click()
    for _ in range(30):  # Tab from the heading to the row's link
        page.keyboard.press("Tab")
        if link.evaluate("el => el === document.activeElement"):
            break
    else:
        pytest.fail("the row link is not reachable by Tab")
    row = page.locator(f"#conflict-list tr:has(a[href='/conflicts/{world.conflict.id}/'])")
    assert row.evaluate("tr => tr.matches(':focus-within')")
    page.keyboard.press("Enter")
    page.wait_for_url(f"**/conflicts/{world.conflict.id}/")


@pytest.mark.parametrize("size", [(390, 844), (1400, 900)])
def test_bulk_keep_current_by_ticking_rows(
    pages: WatchedPages, people: People, world: World, size: tuple[int, int]
) -> None:
    page = pages.new(width=size[0], height=size[1])
    sign_in(page, "rita", PASSWORD)
    page.goto("/conflicts/")
    box = page.get_by_role(
        "checkbox", name=f"Select the conflict on {world.resource.identifier}", exact=False
    )
    box.check()  # the box sits above the row's link: ticking it does not open the conflict
    assert page.url.endswith("/conflicts/")
    assert not check_accessibility(page, f"{size} /conflicts/ bulk")
    page.get_by_label("Comment (required, recorded on each)").fill("superseded")
    page.get_by_role("button", name="Keep current for the selected").click()
    expect(page.locator(".messages")).to_contain_text("Kept the current document for 1 conflict.")
    world.conflict.refresh_from_db()
    assert world.conflict.status == "resolved" and world.conflict.resolution == "keep_current"
