"""Times people read at a glance: dates with a relative part, durations in human
units, and the header's roles apart from owner groups (issue 43)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from approvals.models import Operation
from console.templatetags.console_time import absolute, duration, relative, when
from ownership.models import ConflictClass
from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 6, 2, 24, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (45, "45 s"),
        (900, "15 min"),
        (3600, "1 h"),
        (5400, "1 h 30 min"),
        (86400, "1 day"),
        (172800, "2 days"),
        (90000, "1 day 1 h"),
        (30 * 86400, "30 days"),
    ],
)
def test_durations_read_in_human_units(seconds: int, words: str) -> None:
    assert duration(seconds) == words


def test_a_time_reads_as_a_date_a_utc_clock_time_and_a_distance() -> None:
    moment = datetime(2026, 12, 6, 2, 38, 30, tzinfo=UTC)
    assert absolute(moment, NOW) == "6 Dec 02:38 UTC"
    assert relative(moment, NOW) == "in 14 min"
    assert relative(NOW - timedelta(hours=3, minutes=5), NOW) == "3 h 5 min ago"
    assert relative(NOW + timedelta(seconds=20), NOW) == "just now"
    assert absolute(datetime(2025, 1, 2, 3, 4, tzinfo=UTC), NOW) == "2 Jan 2025 03:04 UTC"


def test_the_when_filter_marks_up_a_machine_readable_time_that_console_js_keeps_current() -> None:
    soon = timezone.now() + timedelta(minutes=14, seconds=30)
    html = str(when(soon))
    iso = soon.astimezone(UTC).isoformat()
    assert html.startswith(f'<time datetime="{iso}"')
    assert f"{absolute(soon, timezone.now())}</time>, " in html
    assert f'<span data-relative="{iso}">in 14 min</span>' in html
    assert when(None) == ""


def test_the_undo_deadline_shows_date_and_distance(people: People, world: World) -> None:
    world.action.status = "applied"
    world.action.save(update_fields=["status"])
    deadline = timezone.now() + timedelta(minutes=14, seconds=30)
    Operation.objects.create(
        action=world.action,
        fence=7,
        status="done",
        base_version=1,
        result_version=2,
        undo_deadline=deadline,
        finished_at=timezone.now(),
    )
    html = client_for(people.owner).get(f"/resources/{world.resource.identifier}/").content.decode()
    expected = f"undo until {when(deadline)}".split('title="')[0]
    assert expected in html and f"{absolute(deadline, timezone.now())}</time>, " in html
    assert ">in 14 min</span>" in html


def test_the_catalog_shows_windows_and_ttls_in_human_units(people: People, world: World) -> None:
    cls = ConflictClass.objects.get(slug="advance_pointer")
    cls.undo_window_seconds = 900
    cls.approval_ttl_seconds = 2 * 86400
    cls.save(update_fields=["undo_window_seconds", "approval_ttl_seconds"])
    html = client_for(people.owner).get("/catalog/").content.decode()
    row = html.split("<code>advance_pointer</code>")[1].split("</tr>")[0]
    assert '<span title="900 s">15 min</span>' in row
    assert '<span title="172800 s">2 days</span>' in row
    assert " s</td>" not in row


def test_the_header_shows_roles_apart_from_owner_groups(people: People, world: World) -> None:
    html = client_for(people.owner).get("/").content.decode()  # pat: owners + platform
    header = html.split('<div class="who">')[1].split("</div>")[0]
    roles = header.split('class="who-roles"')[1].split("</small>")[0]
    groups = header.split('class="who-groups"')[1].split("</small>")[0]
    assert '<span class="role">owner</span>' in roles and "platform" not in roles
    assert "platform" in groups and "owner" not in groups.replace("owner groups", "")
    nobody = client_for(people.outsider).get("/").content.decode()
    assert "no role" in nobody and 'class="who-groups"' not in nobody
