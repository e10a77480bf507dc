"""Standing grants in real Chromium (issue 42 §2): an operator approves a waiting call
with "Approve and allow similar"; the agent's next similar write is admitted by the grant
(no card, a real RQ worker applies it, the action page and the audit trail name the
grant); the operator revokes the grant on the rules page and the agent's third similar
write waits for a person again, its card arriving in the open inbox."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from approvals.models import Action, Grant
from tests.browser.conftest import WatchedPages, check_accessibility, screenshot, sign_in
from tests.fixtures.api import ApiClient, make_agent_with_token
from tests.fixtures.console import PASSWORD, People
from tests.fixtures.engine import wait_for
from tests.test_grants import _create, _flags_run, _pending_approval

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.mark.slow
def test_a_grant_admits_the_next_similar_write_until_it_is_revoked(
    pages: WatchedPages, people: People, rq_worker: Any
) -> None:
    worker = rq_worker()
    api = ApiClient()
    flags = _flags_run(make_agent_with_token("flag-bot").agent)
    first = _pending_approval(api, flags, "team-a-one")

    page = pages.new(width=1400, height=900)
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    card = page.locator(f"#approval-{first.id}")
    card.get_by_text("Approve and allow similar…", exact=True).click()  # the <summary>
    card.get_by_label("Name prefix").fill("team-a-")
    card.get_by_label("Uses").fill("3")
    card.get_by_label("For (minutes)").fill("30")
    card.get_by_label("Comment (required to reject)").fill("the team-a flag family")
    card.get_by_role("button", name="Approve and allow similar").click()
    expect(card).to_have_attribute("data-status", "approved")
    grant = Grant.objects.get(approval=first)
    expect(card.locator(f"#approval-grant-{first.id}")).to_contain_text(
        f"standing grant #{grant.pk}: 3 more writes"
    )
    expect(card.locator(f"#approval-grant-{first.id}")).to_contain_text("feature-flag/team-a-*")
    assert page.url.endswith("/approvals/")  # decided in place
    assert not check_accessibility(page, "inbox-after-grant")

    # The agent's second, similar write: admitted by the grant, no card, applied.
    second = _create(api, flags, "team-a-two").json()
    assert second["status"] == "queued", second
    try:
        wait_for(lambda: Action.objects.get(pk=second["id"]).status == "applied", timeout=30)
    except AssertionError:
        print(worker.output()[-4000:])
        raise
    page.goto("/approvals/")
    expect(page.locator("#approval-items article")).to_have_count(0)
    expect(page.get_by_text("Nothing is waiting for a decision.")).to_be_visible()
    page.goto(f"/actions/{second['id']}/")
    expect(page.locator("#action-grant")).to_contain_text(
        f"Approved without asking by standing grant #{grant.pk} of olivia"
    )
    page.goto(f"/audit/?type=grant.used&action={second['id']}")
    used = page.locator("tbody tr", has_text="grant.used")
    expect(used).to_have_count(1)
    expect(used).to_contain_text(f'"grant": {grant.pk}')
    expect(used).to_contain_text('"uses_left": 2')

    # The rules page lists it (2 of 3 left); its owner revokes it there.
    page.goto("/rules/")
    row = page.locator(f"#grant-{grant.pk}")
    expect(row).to_contain_text("2 of 3")
    expect(row).to_contain_text("live")
    assert not check_accessibility(page, "rules-with-a-grant")
    page.once("dialog", lambda dialog: dialog.accept())  # hx-confirm's "Revoke grant N?"
    row.get_by_role("button", name=f"Revoke grant {grant.pk}").click()
    expect(page.locator(f"#grant-{grant.pk}")).to_contain_text("revoked")
    expect(page.get_by_text(f"Grant {grant.pk} revoked: it admits nothing")).to_be_visible()
    expect(page.locator(f"#grant-{grant.pk}").get_by_role("button")).to_have_count(0)
    screenshot(page, "rules-grant-revoked")

    # The third similar write waits for a person: its card arrives in the open inbox.
    page.goto("/approvals/")
    expect(page.locator("#approval-items article")).to_have_count(0)
    third = _create(api, flags, "team-a-three").json()
    assert third["status"] == "pending_approval", third
    arrived = page.locator("#approval-items article")
    expect(arrived).to_have_count(1, timeout=12_000)  # the inbox's 5 s refresh, no reload
    expect(arrived).to_contain_text("feature-flag/team-a-three")
    expect(arrived).to_have_attribute("data-status", "pending")
    grant.refresh_from_db()
    assert grant.used == 1 and grant.revoked_at is not None
