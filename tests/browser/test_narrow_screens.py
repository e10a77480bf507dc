"""Every console page fits a phone (390 by 844) and a desktop (1400 by 900): no page is wider than
the screen, and axe-core finds nothing serious at either size. The data is the demo's
(`manage.py demo`, through the real API), so each page has rows, diffs and long ids to show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from approvals.models import Action, Plan, Run
from audit.services import Actor
from console.people import person_create
from ownership.models import Conflict, Resource
from tests.browser.conftest import WatchedPages, check_accessibility, screenshot, sign_in
from tests.conftest import ROOT
from tests.deployload import default_environment
from tests.fixtures.console import PASSWORD

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# `make screenshots` sets it: where every page's screenshot goes (an ignored folder).
SHOTS = Path(os.environ["AIRLOCK_SCREENSHOTS"]) if os.environ.get("AIRLOCK_SCREENSHOTS") else None
SIZES = {"phone": (390, 844), "desktop": (1400, 900)}
LIST_PAGES = [
    "/",
    "/approvals/",
    "/runs/",
    "/resources/",
    "/conflicts/",
    "/audit/",
    "/catalog/",
    "/rules/",
    "/tokens/",
    "/people/",
    "/search/?q=prod",
]


@pytest.fixture
def demo(private_redis: Any) -> list[str]:
    """The demo's world, and every page worth looking at in it."""
    # In a process of its own, on the test database: Playwright's event loop runs in this
    # thread (Django's async_to_sync refuses beside it) and the demo's burst worker sets
    # signal handlers (main thread only).
    database = connection.settings_dict
    url = f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}"
    done = subprocess.run(
        [sys.executable, "manage.py", "demo"],
        cwd=ROOT,
        env=default_environment(DATABASE_URL=url, REDIS_URL=private_redis.url),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    person_create(
        user=Actor.system("test"),
        username="ines",
        password=PASSWORD,
        roles=["admin", "operator"],
        groups=["release-owners", "account-owners"],
    )
    resource = Resource.objects.get(kind_id="release-pointer", name="prod-eu")
    details = [
        f"/runs/{Run.objects.order_by('created_at').first().pk}/",  # type: ignore[union-attr]
        f"/conflicts/{Conflict.objects.get().pk}/",
        f"/resources/{resource.kind_id}/{resource.name}/",
        f"/plans/{Plan.objects.get().pk}/",
    ]
    details += [f"/actions/{a.pk}/" for a in Action.objects.order_by("created_at")[:3]]
    return LIST_PAGES + details


@pytest.mark.parametrize("size", sorted(SIZES))
def test_no_page_is_wider_than_the_screen_and_axe_finds_nothing_serious(
    pages: WatchedPages, demo: list[str], size: str
) -> None:
    width, height = SIZES[size]
    page = pages.new(width=width, height=height)
    sign_in(page, "ines", PASSWORD)
    too_wide: list[str] = []
    problems: list[dict[str, Any]] = []
    for path in demo:
        response = page.goto(path)
        assert response is not None and response.status == 200, path
        scroll_width = page.evaluate("document.documentElement.scrollWidth")
        if scroll_width > width:
            too_wide.append(f"{path}: {scroll_width} px")
        problems += check_accessibility(page, f"{size} {path}")
        if SHOTS:  # `make screenshots`: every page at both sizes, for a reviewer's eyes
            name = re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "dashboard"
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / f"{size}-{name}.png"), full_page=True)
    screenshot(page, f"narrow-{size}-last")
    assert not too_wide, f"pages wider than {width} px: {too_wide}"
    assert not problems, problems
