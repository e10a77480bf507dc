"""django-rq's queue dashboard, mounted for staff only (console login), linked from the menu."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.console import People, client_for, make_person

pytestmark = pytest.mark.django_db


def test_staff_see_the_queue_dashboard_and_its_link(people: People) -> None:
    # (django-rq reads its queues from the settings at start: the suite's REDIS_URL.)
    staff = make_person("stella", "admins", superuser=True)
    client = client_for(staff)
    page = client.get("/admin/rq/")
    assert page.status_code == 200
    assert "default" in page.content.decode()  # the engine's queue
    assert 'href="/admin/rq/"' in client.get("/").content.decode()


@pytest.mark.parametrize("who", ["operator", "admin", "outsider"])
def test_people_who_are_not_staff_are_sent_to_sign_in(people: People, who: str) -> None:
    client = client_for(getattr(people, who))
    answer = client.get("/admin/rq/")
    assert answer.status_code == 302 and "/login/" in answer["Location"]
    assert 'href="/admin/rq/"' not in client.get("/").content.decode()


def test_nobody_signed_out_reads_the_queue_stats(db: Any) -> None:
    from django.test import Client

    assert Client().get("/admin/rq/").status_code == 302
    stats = Client().get("/admin/rq/stats.json").json()
    assert stats["error"] is True and "queues" not in stats
