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
    for path in ["/", "/catalog/", f"/runs/{world.run.pk}/", f"/conflicts/{world.conflict.id}/"]:
        page.goto(path)
        problems += check_accessibility(page, f"{size} {path}")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= size[0], (path, width)
    assert not problems, problems
