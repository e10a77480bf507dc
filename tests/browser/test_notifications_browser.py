"""The Notifications page in real Chromium: an admin adds a webhook subscription, sends a
test event, and watches its delivery reach `delivered` in the log without a reload (a real
RQ worker posts it to a real local receiver)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from cryptography.fernet import Fernet
from playwright.sync_api import expect
from standardwebhooks.webhooks import Webhook

from notifications.models import Delivery
from tests.browser.conftest import WatchedPages, check_accessibility, screenshot, sign_in
from tests.fixtures.console import PASSWORD, People
from tests.notify_receiver import Receiver, running_receiver

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running_receiver() as server:
        yield server


def test_an_admin_adds_a_webhook_sends_a_test_and_sees_it_delivered_live(
    pages: WatchedPages, people: People, rq_worker: Any, receiver: Receiver, settings: Any
) -> None:
    key = Fernet.generate_key().decode()
    settings.AIRLOCK_WEBHOOK_ALLOW_HTTP = True
    settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS = ["127.0.0.1"]
    settings.AIRLOCK_NOTIFY_KEY = key
    worker = rq_worker(
        line="notify",
        AIRLOCK_WEBHOOK_ALLOW_HTTP="true",
        AIRLOCK_WEBHOOK_ALLOW_HOSTS="127.0.0.1",
        AIRLOCK_NOTIFY_KEY=key,
    )
    page = pages.new()
    sign_in(page, "ada", PASSWORD)
    page.get_by_role("link", name="Notifications").click()
    page.get_by_role("textbox", name="Name:", exact=True).fill("on-call bridge")
    page.get_by_label("Target").fill("operators")
    page.get_by_label("Channel").select_option("webhook")
    page.get_by_role("textbox", name="URL:", exact=True).fill(receiver.url)
    page.get_by_label("approval.requested").check()
    page.get_by_role("button", name="Add subscription").click()
    secret = page.locator("#new-secret-value")
    expect(secret).to_contain_text("whsec_")
    whsec = secret.inner_text().strip()
    row = page.locator("#notifications-page tbody tr").first
    expect(row).to_contain_text("on-call bridge")
    page.get_by_role("button", name="Send test to subscription").click()
    expect(page.locator("#delivery-log")).to_contain_text("test")
    delivered = page.locator('#delivery-log tr[data-status="delivered"]')
    expect(delivered).to_have_count(1, timeout=30_000)
    expect(delivered).to_contain_text("HTTP 200")
    assert page.url.endswith("/notifications/")  # no navigation: htmx swapped the log
    (request,) = receiver.received
    assert Webhook(whsec).verify(request.body, request.headers)["type"] == "test"
    assert request.headers["webhook-id"] == Delivery.objects.get().webhook_id, worker.output()
    assert check_accessibility(page, "notifications") == []
    screenshot(page, "notifications-delivered")
