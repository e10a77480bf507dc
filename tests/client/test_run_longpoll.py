"""GET /runs/{id} on a real uvicorn: an ETag that changes with the run's status, 304 on
If-None-Match, and `Prefer: wait=N` held until a person's decision commits (woken through
the same publish-after-commit path as actions)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from approvals.api.longpoll import SAFETY_RECHECK_SECONDS
from approvals.models import Approval
from approvals.services.decisions import approval_decide
from approvals.services.runs import run_create
from audit.services import Actor
from tests.fixtures.api import ensure_api_kinds, make_agent_with_token, make_person_with_token
from tests.test_api_longpoll import poll_unchanged, wait_until_held

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def pending_run() -> tuple[Any, str]:
    ensure_api_kinds()
    agent = make_agent_with_token("wait-bot").agent
    run, token = run_create(
        agent=agent,
        task="rotate staging alert routes",
        write_set=[{"resource": "notification-policy/staging-eu", "operations": ["update"]}],
        ttl_seconds=3600,
        actor=Actor.agent(agent),
    )
    assert run.status == "pending_approval"
    return run, token


def held_get(base_url: str, url: str, headers: dict[str, str]) -> Callable[[], httpx.Response]:
    """GET `url` in a background thread, back once the server holds it (a long-poll);
    the function returned joins the thread and answers its response."""
    result: dict[str, httpx.Response] = {}

    def get() -> None:
        result["response"] = httpx.get(url, headers=headers, timeout=40)

    thread = threading.Thread(target=get)
    thread.start()
    wait_until_held(base_url, 1, thread)

    def response() -> httpx.Response:
        thread.join(timeout=40)
        return result["response"]

    return response


def test_it_holds_a_pending_run_until_its_approval_commits(api_server: Any) -> None:
    run, token = pending_run()
    ana = make_person_with_token("ana", "operators")
    url = f"{api_server.url}/api/v1/runs/{run.pk}"
    headers = {"Authorization": f"Bearer {token}"}
    first = httpx.get(url, headers=headers, timeout=5)
    assert first.status_code == 200 and first.json()["status"] == "pending_approval"
    etag = first.headers["ETag"]
    assert etag.startswith('"') and not etag.startswith("W/")
    # Unchanged: 304 at once.
    again = httpx.get(url, headers={**headers, "If-None-Match": etag}, timeout=5)
    assert again.status_code == 304 and again.headers["ETag"] == etag

    waited = held_get(api_server.url, url, {**headers, "Prefer": "wait=30", "If-None-Match": etag})
    approval = Approval.objects.get(run=run, subject="run")
    decided_at = time.monotonic()
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(ana.user), decision="approve", comment="ok"
    )
    response = waited()
    # Woken by the publish, not by the waiter's 15 s safety re-read.
    assert time.monotonic() - decided_at < SAFETY_RECHECK_SECONDS / 2
    assert response.status_code == 200
    assert response.json()["status"] == "active"
    assert response.headers["ETag"] != etag
    assert response.headers["Preference-Applied"] == "wait=30"


def test_it_answers_a_rejected_run_with_its_reason_without_if_none_match(
    api_server: Any,
) -> None:
    run, token = pending_run()
    ana = make_person_with_token("ana", "operators")
    url = f"{api_server.url}/api/v1/runs/{run.pk}"
    headers = {"Authorization": f"Bearer {token}"}
    waited = held_get(api_server.url, url, {**headers, "Prefer": "wait=30"})
    approval = Approval.objects.get(run=run, subject="run")
    approval_decide(
        approval_id=approval.pk,
        actor=Actor.person(ana.user),
        decision="reject",
        comment="not during the freeze",
    )
    body = waited().json()
    assert body["status"] == "rejected"
    assert body["status_reason"] == "not during the freeze"


def test_an_unchanged_run_answers_304_when_the_wait_ends(api_server: Any) -> None:
    run, token = pending_run()
    response, _, held = poll_unchanged(f"{api_server.url}/api/v1/runs/{run.pk}", token)
    assert response.status_code == 304
    assert response.headers["Preference-Applied"] == "wait=1"
    assert held >= 0.9
