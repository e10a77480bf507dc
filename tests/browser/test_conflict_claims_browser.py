"""Claims on the conflicts list in real Chromium (issue 43): while rita looks at her open
conflicts, rob claims one on its page; rita's list names him within its 5 s refresh,
without a reload, and says nobody once he releases it. The list's filters push an address
naming only the filters chosen, and the back button restores the list."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import WatchedPages, check_accessibility, sign_in
from tests.fixtures.console import PASSWORD, People, World, make_person

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_conflicts_list_shows_who_is_on_each_conflict_live(
    pages: WatchedPages, people: People, world: World
) -> None:
    make_person("rob", "release-owners")
    rita = pages.new(width=1400, height=900)
    sign_in(rita, "rita", PASSWORD)
    rita.goto("/conflicts/")
    cell = rita.locator(f"#conflict-claim-{world.conflict.id}")
    expect(cell).to_have_text("nobody yet")
    rita.evaluate("window.__stayed = true")  # gone if the page reloads

    rob = pages.new(width=390, height=844)
    sign_in(rob, "rob", PASSWORD)
    rob.goto(f"/conflicts/{world.conflict.id}/")
    rob.get_by_role("button", name="Claim (“I am on it”)").click()
    expect(rob.locator(f"#claim-conflict-{world.conflict.id}")).to_contain_text("You are on it")
    rob.goto("/conflicts/")
    expect(rob.locator(f"#conflict-claim-{world.conflict.id}")).to_contain_text("You are on it")
    assert not check_accessibility(rob, "conflicts-claimed-narrow")

    expect(cell).to_contain_text("rob is on it", timeout=12_000)
    assert rita.evaluate("window.__stayed === true")
    expect(rita.locator("#conflict-list tbody tr")).to_have_count(1)  # the list itself intact
    assert not check_accessibility(rita, "conflicts-claimed-wide")

    rob.goto(f"/conflicts/{world.conflict.id}/")
    rob.get_by_role("button", name="Release").click()
    expect(rob.locator(f"#claim-conflict-{world.conflict.id}")).to_contain_text("Nobody")
    expect(cell).to_have_text("nobody yet", timeout=12_000)
    assert rita.evaluate("window.__stayed === true")

    # The list's filters push an address naming only what was chosen; back restores.
    rita.get_by_label("Class", exact=True).select_option("add_unique")
    rita.wait_for_url("**/conflicts/?scope=mine&status=open&class=add_unique")
    expect(rita.get_by_text("No conflicts match these filters.")).to_be_visible()
    rita.go_back()
    rita.wait_for_url("**/conflicts/")
    expect(rita.locator(f"#conflict-claim-{world.conflict.id}")).to_have_text("nobody yet")
    expect(rita.get_by_label("Class", exact=True)).to_have_value("")
