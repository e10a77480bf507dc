"""An open approvals inbox picks up new approvals by polling: only the new
cards come back (appended out of band), nothing is repeated, nothing missed."""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Approval
from tests.fixtures.console import People, World, client_for, make_run

pytestmark = pytest.mark.django_db

HX = {"HTTP_HX_REQUEST": "true"}


def _poll_url(html: str) -> str:
    match = re.search(r'id="approval-poll" hx-get="([^"]+)"', html)
    assert match, "the inbox has no poller"
    return unescape(match.group(1))


def _open_inbox(person: Any) -> tuple[Any, str]:
    """`person`'s approvals inbox, opened: their client and the URL its poller calls."""
    client = client_for(person)
    return client, _poll_url(client.get("/approvals/").content.decode())


def _new_run_approval(world: World, task: str) -> Approval:
    run = make_run(world.agent, status="pending_approval", task=task)
    return Approval.objects.create(
        subject="run", run=run, quorum=1, expires_at=timezone.now() + timedelta(hours=1)
    )


def test_a_poll_without_news_is_a_204_and_swaps_nothing(people: People, world: World) -> None:
    client, url = _open_inbox(people.operator)
    response = client.get(url, **HX)
    assert response.status_code == 204 and response.content == b""


def test_a_new_approval_comes_back_once_as_an_out_of_band_card(
    people: People, world: World
) -> None:
    client, url = _open_inbox(people.operator)
    new = _new_run_approval(world, "rotate the pager key")
    response = client.get(url, **HX)
    assert response.status_code == 200 and "counts-changed" in response["HX-Trigger"]
    html = response.content.decode()
    assert "<html" not in html
    assert 'hx-swap-oob="beforeend:#approval-items"' in html
    assert f'id="approval-{new.id}"' in html and "rotate the pager key" in html
    # The cards already on the page are not sent again (a comment being typed survives).
    assert f'id="approval-{world.approval.id}"' not in html
    assert f'id="approval-{world.run_approval.id}"' not in html
    # The fresh poller carries the cursor on: the same card is not sent twice.
    again = client.get(_poll_url(html), **HX)
    assert again.status_code == 204


def test_an_approval_that_commits_late_with_an_older_timestamp_is_not_missed(
    people: People, world: World
) -> None:
    client, url = _open_inbox(people.operator)
    late = _new_run_approval(world, "late committer")
    # Inserted before the page was rendered, committed after: created_at is older.
    Approval.objects.filter(pk=late.pk).update(created_at=timezone.now() - timedelta(seconds=30))
    html = client.get(url, **HX).content.decode()
    assert f'id="approval-{late.id}"' in html


def test_the_poll_shows_only_what_the_person_may_decide(people: People, world: World) -> None:
    client, url = _open_inbox(people.outsider)
    _new_run_approval(world, "not for outsiders")
    assert client.get(url, **HX).status_code == 204


def test_a_bad_cursor_is_a_400(people: People, world: World) -> None:
    client = client_for(people.operator)
    assert client.get("/approvals/poll/?since=yesterday", **HX).status_code == 400
    assert client.get("/approvals/poll/", **HX).status_code == 400


def test_the_poll_needs_a_session(world: World) -> None:
    from django.test import Client

    assert Client().get("/approvals/poll/?since=2026-01-01T00:00:00Z").status_code == 302


def test_a_poll_is_a_bounded_number_of_queries(
    people: People, world: World, django_assert_max_num_queries: Any
) -> None:
    client, url = _open_inbox(people.operator)
    for n in range(10):
        _new_run_approval(world, f"burst {n}")
    with django_assert_max_num_queries(8):
        response = client.get(url, **HX)
    assert response.content.decode().count('class="card approval"') == 10
