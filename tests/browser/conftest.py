"""Real Chromium (Debian's /usr/bin/chromium) driven by Playwright.

Every page the tests open is watched: a Content-Security-Policy violation, a
console error or an uncaught page error fails the test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
AXE = Path(__file__).resolve().parent / "vendor" / "axe.min.js"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Recorded inside the page (init scripts run before the page's own scripts and
# are not subject to its CSP), read back after each step.
WATCH_CSP = """
window.__cspViolations = [];
document.addEventListener('securitypolicyviolation', function (e) {
  var where = e.target && e.target.outerHTML ? e.target.outerHTML.slice(0, 160) : '';
  window.__cspViolations.push(e.violatedDirective + ' ' + e.blockedURI + ' ' + e.sourceFile + ':' +
    e.lineNumber + ' sample=' + e.sample + ' at ' + where);
});
"""


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """One browser per test module, closed afterwards: while Playwright's sync API
    holds its event loop in this thread, Django would refuse ORM calls from the
    tests, so the loop must not outlive the browser tests (and the escape hatch
    below is scoped to them)."""
    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is missing: run scripts/install-browser.sh")
    from playwright.sync_api import sync_playwright

    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
            )
            yield browser
            browser.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


class WatchedPages:
    """Pages opened for one test, with everything that went wrong on them."""

    def __init__(self, browser: Any, base_url: str) -> None:
        self.browser = browser
        self.base_url = base_url
        self.contexts: list[Any] = []
        self.problems: list[str] = []
        self.pages: list[Any] = []
        self.allowed: list[str] = []

    def allow(self, text: str) -> None:
        """A console message the test provokes on purpose (e.g. a 422 it asserts on)."""
        self.allowed.append(text)

    def unexpected_problems(self) -> list[str]:
        return [p for p in self.problems if not any(a in p for a in self.allowed)]

    def new(self, *, javascript: bool = True, width: int = 1280, height: int = 900) -> Any:
        context = self.browser.new_context(
            base_url=self.base_url,
            viewport={"width": width, "height": height},
            java_script_enabled=javascript,
        )
        self.contexts.append(context)
        page = context.new_page()
        page.add_init_script(WATCH_CSP)
        page.on(
            "console",
            lambda msg: (
                self.problems.append(f"console {msg.type}: {msg.text}")
                if msg.type == "error"
                else None
            ),
        )
        page.on("pageerror", lambda exc: self.problems.append(f"page error: {exc}"))
        page.set_default_timeout(15_000)
        self.pages.append(page)
        return page

    def csp_violations(self) -> list[str]:
        found: list[str] = []
        for page in self.pages:
            if page.is_closed() or not page.context.pages:
                continue
            if page.evaluate("typeof window") != "object":  # JavaScript disabled
                continue
            try:
                found += page.evaluate("window.__cspViolations || []")
            except Exception as exc:  # a page mid-navigation
                found.append(f"could not read CSP violations: {exc}")
        return found

    def close(self) -> None:
        for context in self.contexts:
            context.close()


@pytest.fixture
def pages(chromium: Any, live_server: Any) -> Iterator[WatchedPages]:
    watched = WatchedPages(chromium, live_server.url)
    yield watched
    violations = watched.csp_violations()
    problems = watched.unexpected_problems()
    watched.close()
    assert not violations, f"CSP violations: {violations}"
    assert not problems, f"browser errors: {problems}"


def sign_in(page: Any, username: str, password: str) -> None:
    page.goto("/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda url: "/login/" not in url)


def check_accessibility(page: Any, name: str) -> list[dict[str, Any]]:
    """Run axe-core in the page; return the serious and critical violations."""
    page.evaluate(AXE.read_text())
    result = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    return [
        {
            "page": name,
            "id": v["id"],
            "impact": v["impact"],
            "help": v["help"],
            "targets": [n["target"] for n in v["nodes"]][:5],
        }
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
