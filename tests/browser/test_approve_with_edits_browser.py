"""Approve with edits in real Chromium (issue 42 §1): an operator opens the card's edit
form, changes the proposed JSON and approves it; the card shows the original superseded
and a real RQ worker applies the edited write. Without JavaScript, a malformed edit is
shown in the card with the text as typed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from approvals.models import Action
from ownership.models import OwnershipRecord, Resource
from tests.browser.conftest import WatchedPages, check_accessibility, screenshot, sign_in
from tests.fixtures.console import PASSWORD, People, World
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _cover(world: World) -> None:
    """The world's run holds prod-alerts for update (as its activation records)."""
    OwnershipRecord.objects.create(
        run=world.run,
        kind=world.kind,
        name="prod-alerts",
        operations=["update"],
        expires_at=timezone.now() + timedelta(hours=1),
    )


@pytest.mark.slow
def test_an_operator_approves_with_edits_and_the_edited_write_is_applied(
    pages: WatchedPages, people: People, world: World, rq_worker: Any
) -> None:
    _cover(world)
    rq_worker()
    page = pages.new()
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    card = page.locator(f"#approval-{world.approval.id}")
    card.get_by_text("Approve with edits", exact=True).first.click()  # the <summary>
    document = card.get_by_label("Proposed merge patch (JSON)")
    expect(document).to_have_value('{\n  "channels": [\n    "email",\n    "pager"\n  ]\n}')
    assert not check_accessibility(page, "approvals-edit-form")
    document.fill('{"channels": ["email", "sms"]}')
    card.get_by_label("Comment", exact=True).fill("sms, not pager")
    card.get_by_role("button", name="Approve with edits").click()
    status = page.locator(f"#action-status-{world.action.id}")
    expect(status).to_have_attribute("data-status", "superseded", timeout=10_000)
    assert page.url.endswith("/approvals/")  # in place, no navigation
    world.action.refresh_from_db()
    edited_id = world.action.superseded_by_id
    assert edited_id is not None
    wait_for(lambda: Action.objects.get(pk=edited_id).status == "applied", timeout=30)
    resource = Resource.objects.get(pk=world.resource.pk)
    assert resource.version == 3 and resource.document["channels"] == ["email", "sms"]
    screenshot(page, "approvals-after-edit")


def test_without_javascript_a_malformed_edit_is_shown_in_the_card(
    pages: WatchedPages, people: People, world: World
) -> None:
    _cover(world)
    page = pages.new(javascript=False)
    pages.allow("422")
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    card = page.locator(f"#approval-{world.approval.id}")
    card.get_by_text("Approve with edits", exact=True).first.click()
    card.get_by_label("Proposed merge patch (JSON)").fill('{"channels": [')
    card.get_by_role("button", name="Approve with edits").click()
    card = page.locator(f"#approval-{world.approval.id}")
    expect(card.locator(".error")).to_contain_text("not valid JSON")
    expect(card.get_by_label("Proposed merge patch (JSON)")).to_have_value('{"channels": [')
    world.action.refresh_from_db()
    assert world.action.status == "pending_approval"
