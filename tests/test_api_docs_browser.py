"""The API docs page in real Chromium under the site's strict CSP: Swagger UI
renders from assets served by the app (no CDN), with no CSP violation and no
console error (the console area's watched-page fixtures enforce both)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser.conftest import chromium, pages  # noqa: F401 - fixtures

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_docs_page_renders_the_operations_offline(pages: Any) -> None:  # noqa: F811
    page = pages.new()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto("/api/v1/docs")
    page.wait_for_selector(".opblock", timeout=20_000)
    assert page.locator(".opblock").count() >= 25
    assert all(url.startswith(pages.base_url) for url in requested), requested
