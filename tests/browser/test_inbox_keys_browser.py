"""The keyboard-first inbox and claims in real Chromium (issues 42 §3 and 43): an operator
clears a queue of five approvals with the keyboard alone (one approved with edits through
`e`, one rejected through `r`); a second person sees a claim live and must take it over;
axe-core clean at 1400x900 and 390x844."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from approvals.models import Action, Approval, Grant, Run
from ownership.models import OwnershipRecord
from tests.browser.conftest import WatchedPages, check_accessibility, sign_in
from tests.fixtures.console import PASSWORD, People, World, make_person

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _more_call_approvals(world: World, count: int) -> list[Approval]:
    made = []
    for n in range(count):
        action = Action.objects.create(
            run=world.run,
            agent=world.agent,
            kind=world.kind,
            name="prod-alerts",
            resource=world.resource,
            operation="update",
            payload_format="merge_patch",
            payload={"note": f"change {n}"},
            observed_version=2,
            conflict_class=world.action.conflict_class,
            status="pending_approval",
        )
        made.append(
            Approval.objects.create(
                subject="action",
                run=world.run,
                action=action,
                quorum=1,
                observed_version=2,
                expires_at=timezone.now() + timedelta(hours=2),
            )
        )
    return made


def test_an_operator_clears_five_approvals_with_the_keyboard(
    pages: WatchedPages, people: People, world: World
) -> None:
    OwnershipRecord.objects.create(  # the run holds prod-alerts, as the edit's checks ask
        run=world.run,
        kind=world.kind,
        name="prod-alerts",
        operations=["update"],
        expires_at=timezone.now() + timedelta(hours=1),
    )
    queue = [world.approval, *_more_call_approvals(world, 4)]
    # The fifth is of a class that allows standing grants (replace_shared_document does not:
    # its cards offer no grant form).
    Action.objects.filter(pk=queue[4].action_id).update(conflict_class_id="advance_pointer")
    # A grant is never wider than the run's write set: it declares the prod-* policies.
    Run.objects.filter(pk=world.run.pk).update(
        write_set=[{"resource": "notification-policy/prod-*", "operations": ["update"]}]
    )
    # The run approval (another run's start) is not part of this queue.
    Approval.objects.filter(pk=world.run_approval.pk).update(status="cancelled")
    page = pages.new(width=1400, height=900)
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    expect(page.locator("#inbox-keys-hint")).to_be_visible()
    kb = page.keyboard
    kb.press("?")
    expect(page.locator("#inbox-keys-help")).to_be_visible()
    assert not check_accessibility(page, "inbox-keys-help")
    kb.press("Escape")
    # 1: the first card, approved with edits (e, type, Ctrl+Enter is not needed: Tab to the button).
    kb.press("j")
    expect(page.locator(f"#approval-{queue[0].id}")).to_be_focused()
    kb.press("e")
    document = page.locator(f"#edit-document-{queue[0].id}")
    expect(document).to_be_focused()
    document.fill('{"channels": ["email", "sms"]}')
    kb.press("Tab")  # the comment
    kb.press("Tab")  # Approve with edits
    kb.press("Enter")
    first = page.locator(f"#approval-{queue[0].id}")
    # The agent's write is superseded by the edited one: its approval ends cancelled.
    expect(first).to_have_attribute("data-status", "cancelled")
    expect(first).to_be_focused()  # the swap did not take the focus elsewhere
    # 2 and 3: approved with a
    for approval in queue[1:3]:
        kb.press("j")
        expect(page.locator(f"#approval-{approval.id}")).to_be_focused()
        kb.press("a")
        expect(page.locator(f"#approval-{approval.id}")).to_have_attribute(
            "data-status", "approved"
        )
    # 4: rejected with r, the comment, Ctrl+Enter
    kb.press("j")
    kb.press("r")
    comment = page.locator(f"#comment-{queue[3].id}")
    expect(comment).to_be_focused()
    kb.type("not now")
    kb.press("Control+Enter")
    expect(page.locator(f"#approval-{queue[3].id}")).to_have_attribute("data-status", "rejected")
    # 5: g opens the grant form (its first field); Escape returns to the card and leaves it
    # pending; g again, Tab through uses and minutes to "Approve and allow similar", Enter.
    kb.press("j")
    expect(page.locator(f"#approval-{queue[4].id}")).to_be_focused()
    kb.press("g")
    expect(page.locator(f"#grant-prefix-{queue[4].id}")).to_be_focused()
    kb.press("Escape")
    expect(page.locator(f"#approval-{queue[4].id}")).to_be_focused()
    expect(page.locator(f"#approval-{queue[4].id}")).to_have_attribute("data-status", "pending")
    kb.press("g")
    expect(page.locator(f"#grant-prefix-{queue[4].id}")).to_be_focused()
    kb.press("Tab")  # uses (3)
    kb.press("Tab")  # minutes (60)
    kb.press("Tab")  # Approve and allow similar
    expect(page.locator(f"#approval-{queue[4].id} [data-grant-approve]")).to_be_focused()
    kb.press("Enter")
    expect(page.locator(f"#approval-{queue[4].id}")).to_have_attribute("data-status", "approved")
    [grant] = Grant.objects.filter(owner=people.operator)
    assert (grant.uses, grant.used, grant.run_id) == (3, 0, queue[4].action.run_id)
    statuses = dict(
        Approval.objects.filter(pk__in=[a.pk for a in queue]).values_list("id", "status")
    )
    assert [statuses[a.pk] for a in queue] == [
        "cancelled",
        "approved",
        "approved",
        "rejected",
        "approved",
    ]
    world.action.refresh_from_db()
    assert world.action.status == "superseded" and world.action.superseded_by_id is not None


def test_a_claim_is_seen_live_by_another_person_and_taken_over(
    pages: WatchedPages, people: People, world: World
) -> None:
    make_person("ana", "operators")
    ana = pages.new(width=1400, height=900)
    sign_in(ana, "ana", PASSWORD)
    ana.goto("/approvals/")
    olivia = pages.new(width=390, height=844)
    sign_in(olivia, "olivia", PASSWORD)
    olivia.goto("/approvals/")
    card = f"#approval-{world.approval.id}"
    ana.locator(card).get_by_role("button", name="Claim (“I am on it”)").click()
    expect(ana.locator(card)).to_contain_text("You are on it")
    # Olivia's open inbox shows it within its 5 s refresh, without a reload.
    expect(olivia.locator(card)).to_contain_text("ana is on it", timeout=12_000)
    assert not check_accessibility(olivia, "inbox-claimed-narrow")
    olivia.locator(card).get_by_role("button", name="Take over from ana").click()
    expect(olivia.locator(card)).to_contain_text("You are on it")
    expect(ana.locator(card)).to_contain_text("olivia is on it", timeout=12_000)
    assert not check_accessibility(ana, "inbox-claimed-wide")
