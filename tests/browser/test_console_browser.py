"""The console in real Chromium: approve, resolve, kill switch, every page's look and a11y.

The live server runs in this process's threads on the test database; writes are
executed by a real `rqworker` subprocess on a private Redis (the engine's
`rq_worker` fixture), so "applied" on screen means the barrier really applied it.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Group
from playwright.sync_api import expect

from approvals.models import Action
from audit.services import Actor
from ownership.models import Conflict, Resource
from tests.browser.conftest import WatchedPages, check_accessibility, screenshot, sign_in
from tests.fixtures.console import PASSWORD, People, World

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.mark.slow
def test_an_operator_approves_a_call_and_watches_it_reach_applied(
    pages: WatchedPages, people: People, world: World, rq_worker: Any
) -> None:
    rq_worker()
    page = pages.new()
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    card = page.locator(f"#approval-{world.approval.id}")
    expect(card).to_contain_text("Call approval: update notification-policy/prod-alerts")
    expect(card.locator(".diff")).to_contain_text("pager")
    badge = page.locator("#nav-count-approvals .badge")
    expect(badge).to_have_attribute("data-count", "2")
    # Keyboard only: focus the comment, type, tab to Approve, press Enter.
    card.get_by_label("Comment (required to reject)").fill("pager channel is right")
    card.get_by_label("Comment (required to reject)").press("Tab")
    focused = page.evaluate("document.activeElement.textContent.trim()")
    assert focused == "Approve"
    page.keyboard.press("Enter")
    status = page.locator(f"#action-status-{world.action.id}")
    expect(status).to_have_attribute("data-status", "applied", timeout=30_000)
    expect(page.locator(f"#approval-{world.approval.id}")).to_contain_text("Decided at")
    expect(badge).to_have_attribute("data-count", "1")  # HX-Trigger refreshed the counter
    assert page.url.endswith("/approvals/")  # no reload, no navigation
    resource = Resource.objects.get(pk=world.resource.pk)
    assert resource.version == 3 and resource.document["channels"] == ["email", "pager"]
    screenshot(page, "approvals-after-approve")


@pytest.mark.slow
def test_a_resource_owner_merges_a_conflict_per_field_and_sees_the_new_action_applied(
    pages: WatchedPages, people: People, world: World, rq_worker: Any
) -> None:
    worker = rq_worker()
    page = pages.new()
    sign_in(page, "rita", PASSWORD)
    page.goto("/conflicts/")
    page.get_by_role("link", name=world.conflict.created_at.strftime("%Y-%m-%d")).first.click()
    expect(page.locator("h1")).to_contain_text("Conflict on notification-policy/prod-alerts")
    preview = page.locator("#preview")
    expect(preview).to_contain_text("team-b")  # default: keep the other run's on-call
    page.get_by_role("group", name="Value for /oncall").get_by_label("proposed").check()
    expect(preview).to_contain_text("team-a")
    expect(preview).to_contain_text("sms")
    page.get_by_role("group", name="Value for /oncall").get_by_label("current").check()
    expect(preview).to_contain_text("team-b")
    page.get_by_label("Comment").fill("take the sms channel, keep team-b")
    page.get_by_role("button", name="Resolve").click()
    expect(page.locator("#resolution")).to_contain_text("merge per field by rita")
    expect(page.locator("h1 .status")).to_have_text("resolved")  # the whole page moved on
    conflict = Conflict.objects.get(pk=world.conflict.pk)
    assert conflict.status == "resolved" and conflict.resolution_action_id is not None
    status = page.locator(f"#action-status-{conflict.resolution_action_id}")
    try:
        expect(status).to_have_attribute("data-status", "applied", timeout=30_000)
    except AssertionError:
        print(worker.output()[-4000:])
        raise
    resource = Resource.objects.get(pk=world.resource.pk)
    assert resource.document == {
        "channels": ["email", "sms"],
        "severity": "high",
        "oncall": "team-b",
    }
    assert Action.objects.get(pk=conflict.resolution_action_id).status == "applied"
    screenshot(page, "conflict-resolved")


def test_the_kill_switch_banner_appears_and_disappears_without_reload(
    pages: WatchedPages, people: People, world: World
) -> None:
    operator = pages.new()
    sign_in(operator, "olivia", PASSWORD)
    watcher = pages.new()
    sign_in(watcher, "aud", PASSWORD)
    watcher.goto("/runs/")
    expect(watcher.locator(".banner")).to_have_count(0)

    operator.goto("/")
    # A mistake is explained in place (htmx swaps the 422 fragment).
    pages.allow("the server responded with a status of 422")
    operator.get_by_label("I understand this stops or resumes writes in this scope").check()
    operator.get_by_role("button", name="Engage").click()
    expect(operator.locator("#killswitch .error")).to_contain_text("Say why")
    operator.get_by_label("Scope", exact=True).fill("*")
    operator.get_by_label("Reason (required to engage; shown on every page)").fill("incident 42")
    operator.get_by_label("I understand this stops or resumes writes in this scope").check()
    operator.get_by_role("button", name="Engage").click()
    expect(operator.locator("#killswitch")).to_contain_text("engaged")
    expect(operator.locator(".banner")).to_contain_text("incident 42", timeout=10_000)
    # The auditor's page was not reloaded: the banner polls itself in.
    expect(watcher.locator(".banner")).to_contain_text("incident 42", timeout=10_000)
    screenshot(operator, "dashboard-kill-switch-engaged")

    operator.get_by_label("I understand this stops or resumes writes in this scope").check()
    operator.get_by_role("button", name="Release").click()
    expect(operator.locator("#killswitch")).to_contain_text("released")
    expect(operator.locator(".banner")).to_have_count(0, timeout=10_000)
    expect(watcher.locator(".banner")).to_have_count(0, timeout=10_000)


def test_every_main_page_reads_well_and_has_no_serious_accessibility_violation(
    pages: WatchedPages, people: People, world: World
) -> None:
    for name in ("release-owners", "platform", "operators"):
        people.admin.groups.add(Group.objects.get_or_create(name=name)[0])
    world.audit("action.proposed", details={"operation": "update"})
    world.audit("conflict.opened", actor=Actor.system(), action=world.conflict_action)
    page = pages.new()
    page.goto("/login/")
    problems = check_accessibility(page, "login")
    screenshot(page, "login")
    sign_in(page, "ada", PASSWORD)
    targets = {
        "dashboard": "/",
        "approvals": "/approvals/",
        "conflicts": "/conflicts/",
        "conflict": f"/conflicts/{world.conflict.id}/",
        "runs": "/runs/",
        "run": f"/runs/{world.run.id}/",
        "action": f"/actions/{world.action.id}/",
        "resources": "/resources/",
        "resource": f"/resources/{world.resource.identifier}/",
        "catalog": "/catalog/",
        "audit": "/audit/",
        "tokens": "/tokens/",
        "rules": "/rules/",
        "people": "/people/",
    }
    for name, path in targets.items():
        page.goto(path)
        expect(page.locator("main h1")).to_be_visible()
        if name == "audit":
            expect(page.locator("#verify-badge")).to_contain_text("Chain verified")
        problems += check_accessibility(page, name)
        screenshot(page, name)
    assert not problems, problems


@pytest.mark.slow
def test_every_decision_works_without_javascript(
    pages: WatchedPages, people: People, world: World, rq_worker: Any
) -> None:
    rq_worker()
    page = pages.new(javascript=False)
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    card = page.locator(f"#approval-{world.approval.id}")
    card.get_by_label("Comment (required to reject)").fill("fine")
    card.get_by_role("button", name="Approve").click()
    page.wait_for_url("**/approvals/")
    expect(page.locator(".messages")).to_contain_text("Decision recorded.")
    page.goto(f"/actions/{world.action.id}/")
    for _ in range(30):  # no htmx: the person reloads
        if page.locator("h1 .status").get_attribute("data-status") == "applied":
            break
        page.wait_for_timeout(500)
        page.reload()
    expect(page.locator("h1 .status")).to_have_attribute("data-status", "applied")

    page.goto(f"/conflicts/{world.conflict.id}/")
    expect(page.locator("#resolution")).to_contain_text("Only members of release-owners")
    page.goto("/")
    page.get_by_label("Reason (required to engage; shown on every page)").fill("maintenance")
    page.get_by_label("I understand this stops or resumes writes in this scope").check()
    page.get_by_role("button", name="Engage").click()
    expect(page.locator(".banner")).to_contain_text("maintenance")


def test_an_open_inbox_shows_a_new_approval_without_losing_a_typed_comment(
    pages: WatchedPages, people: People, world: World
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from approvals.models import Approval
    from tests.fixtures.console import make_run

    page = pages.new()
    sign_in(page, "olivia", PASSWORD)
    page.goto("/approvals/")
    comment = page.locator(f"#approval-{world.approval.id}").get_by_label(
        "Comment (required to reject)"
    )
    comment.fill("half-written thought")
    run = make_run(world.agent, status="pending_approval", task="arrived while open")
    fresh = Approval.objects.create(
        subject="run", run=run, quorum=1, expires_at=timezone.now() + timedelta(hours=1)
    )
    expect(page.locator(f"#approval-{fresh.id}")).to_contain_text(
        "arrived while open", timeout=15_000
    )
    expect(page.locator("#approval-items article.approval")).to_have_count(3)
    expect(comment).to_have_value("half-written thought")
    expect(page.locator(".approval-empty")).to_be_hidden()
    assert page.url.endswith("/approvals/")
    screenshot(page, "approvals-live")


def test_an_admin_adds_a_rule_in_place(pages: WatchedPages, people: People, world: World) -> None:
    page = pages.new()
    sign_in(page, "ada", PASSWORD)
    page.goto("/rules/")
    page.get_by_label("Name prefix").fill("sandbox-")
    page.get_by_label("update").check()
    page.get_by_role("button", name="Add rule").click()
    expect(page.locator("#rules-page .notice-ok")).to_contain_text("created")
    expect(page.locator("#rules-page")).to_contain_text("notification-policy/sandbox-*")
    assert page.url.endswith("/rules/")
    screenshot(page, "rules")
