"""Under ASGI, Django's middlewares run their header-only hooks on the event loop instead
of handing each hook to a thread (console.middleware): an API poll makes a handful of
thread hand-offs, not twenty; answers and their headers are unchanged, and what does I/O
(a session saved at login) still goes to a thread."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from asgiref.sync import SyncToAsync, async_to_sync

from bench.asgi_get import asgi_get
from tests.fixtures.console import PASSWORD, make_person
from tests.fixtures.core import make_action

HEADERS_KEPT = (
    "Content-Type",
    "Content-Length",
    "ETag",
    "Cache-Control",
    "X-Frame-Options",
    "X-Content-Type-Options",
    "Referrer-Policy",
    "Cross-Origin-Opener-Policy",
    "Content-Security-Policy",
)


@pytest.fixture
def counted_hops() -> Iterator[list[Any]]:
    """Every sync_to_async call made while the test runs (the functions handed over)."""
    calls: list[Any] = []
    original = SyncToAsync.__call__

    async def counting(self: SyncToAsync[Any, Any], *args: Any, **kwargs: Any) -> Any:
        calls.append(self.func)
        return await original(self, *args, **kwargs)

    SyncToAsync.__call__ = counting  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        SyncToAsync.__call__ = original  # type: ignore[method-assign]


def console_get(path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """One GET through the web process's application (console.asgi), in this process."""
    from console.asgi import application  # reason: builds the ASGI handler; only here

    messages = async_to_sync(asgi_get)(application, path, host="testserver", headers=headers)
    start = next(m for m in messages if m["type"] == "http.response.start")
    answer_headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], answer_headers, body


@pytest.mark.django_db(transaction=True)
def test_an_api_poll_under_asgi_hands_few_hooks_to_threads(
    run: Any, api: Any, counted_hops: list[Any]
) -> None:
    action = make_action(
        run=run.run, identifier="dns-record/app-1", operation="create", payload={"n": 1}
    )
    url = f"/api/v1/actions/{action.pk}"
    sync_answer = api.get(url, token=run.token)
    assert sync_answer.status_code == 200
    counted_hops.clear()
    status, headers, body = console_get(url, {"Authorization": f"Bearer {run.token}"})
    assert status == 200
    assert body == sync_answer.content
    for header in HEADERS_KEPT:
        assert headers.get(header.lower()) == sync_answer.get(header), header
    # The view's read and the request started/finished signals (3); with Django's
    # MiddlewareMixin as it is, two more per middleware and CSRF's process_view (18).
    assert len(counted_hops) <= 3, [getattr(f, "__qualname__", f) for f in counted_hops]


def test_a_console_login_over_uvicorn_still_saves_its_session(api_server: Any) -> None:
    """Saving the session (database work) keeps its thread; CSRF still guards forms."""
    make_person("asgi-login", "platform")
    with httpx.Client(base_url=api_server.url, follow_redirects=False, timeout=30) as client:
        form = client.get("/login/")
        assert form.status_code == 200
        # A form posted without its CSRF token is still refused (checked in a thread).
        forged = client.post("/login/", data={"username": "asgi-login", "password": PASSWORD})
        assert forged.status_code == 403
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
        assert token is not None
        done = client.post(
            "/login/",
            data={
                "username": "asgi-login",
                "password": PASSWORD,
                "csrfmiddlewaretoken": token.group(1),
            },
            headers={"Referer": f"{api_server.url}/login/"},
        )
        assert done.status_code == 302, done.text[:500]
        assert "sessionid" in client.cookies
        home = client.get("/")
        assert home.status_code == 200
        assert "asgi-login" in home.text
