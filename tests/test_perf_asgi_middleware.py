"""Under ASGI, Django's middlewares run their header-only hooks on the event loop instead
of handing each hook to a thread (console.middleware): an API poll makes a handful of
thread hand-offs, not twenty; answers and their headers are unchanged, and what does I/O
(a session saved at login) still goes to a thread."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from asgiref.sync import SyncToAsync, async_to_sync
from django.core.signals import request_started
from django.db import connections

from bench.asgi_get import asgi_get
from console.middleware import AirlockASGIHandler, RequestThreads
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


def _request_threads(handler: AirlockASGIHandler, path: str, token: str) -> list[int]:
    """The thread each of four requests' sync work ran on (its request_started receiver's),
    sent one after another to `handler`."""
    seen: list[int] = []

    def note(**kwargs: Any) -> None:
        seen.append(threading.get_ident())

    request_started.connect(note)
    try:
        for _ in range(4):
            headers = {"Authorization": f"Bearer {token}"}
            messages = async_to_sync(asgi_get)(handler, path, host="testserver", headers=headers)
            assert messages[0]["status"] == 200
    finally:
        request_started.disconnect(note)
    return seen


@pytest.mark.django_db(transaction=True)
def test_requests_one_after_another_reuse_one_kept_thread(run: Any, monkeypatch: Any) -> None:
    """Django's handler started a thread for every request (and another to join it); the
    web process's handler lends a kept one, as a WSGI server reuses its threads — where
    each request's connection is closed at its end, as in a web process (pooled)."""
    action = make_action(
        run=run.run, identifier="dns-record/app-1", operation="create", payload={"n": 1}
    )
    path = f"/api/v1/actions/{action.pk}"
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    handler = AirlockASGIHandler()
    threads = _request_threads(handler, path, run.token)
    assert len(threads) == 4 and len(set(threads)) == 1, threads
    assert threads[0] != threading.get_ident()  # a request thread, not the caller's
    # Nothing of the last request's is left open on the kept thread.
    assert handler.threads.idle == 1
    kept = handler.threads.borrow()
    assert kept.submit(lambda: connections["default"].connection is None).result()


@pytest.mark.django_db(transaction=True)
def test_with_persistent_connections_each_request_has_a_thread_of_its_own(run: Any) -> None:
    """CONN_MAX_AGE > 0 (this test process's setting): a kept thread would keep its
    connection open, so no thread is kept — Django's behaviour."""
    action = make_action(
        run=run.run, identifier="dns-record/app-1", operation="create", payload={"n": 1}
    )
    assert connections.settings["default"]["CONN_MAX_AGE"] > 0
    handler = AirlockASGIHandler()
    threads = _request_threads(handler, f"/api/v1/actions/{action.pk}", run.token)
    assert len(threads) == 4 and handler.threads.idle == 0


def test_the_pool_lends_each_borrower_its_own_thread_and_keeps_at_most_keep() -> None:
    kept = RequestThreads(keep=1)
    first, second = kept.borrow(), kept.borrow()
    assert first is not second
    idents = {
        first.submit(threading.get_ident).result(),
        second.submit(threading.get_ident).result(),
    }
    assert len(idents) == 2
    kept.give_back(first)
    kept.give_back(second)  # over the one kept: ended
    assert kept.idle == 1
    assert kept.borrow() is first
    with pytest.raises(RuntimeError):
        second.submit(threading.get_ident)


def test_a_thread_still_running_a_left_request_s_work_is_not_lent_again() -> None:
    """A request whose client went away leaves its sync work running on its thread: the
    next request gets a thread of its own instead of queueing behind that work, and the
    busy one ends when its work does."""
    kept = RequestThreads(keep=4)
    left = kept.borrow()
    release = threading.Event()
    still_running = left.submit(release.wait, 10)
    kept.give_back(left)
    assert kept.idle == 0
    nxt = kept.borrow()
    assert nxt is not left
    assert nxt.submit(lambda: "answered at once").result(timeout=2) == "answered at once"
    release.set()
    assert still_running.result(timeout=5) is True
    with pytest.raises(RuntimeError):  # ended, not kept
        left.submit(threading.get_ident)
    kept.give_back(nxt)  # idle: kept
    assert kept.idle == 1 and kept.borrow() is nxt
