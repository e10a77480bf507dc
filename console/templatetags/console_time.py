"""Times as people read them: a date, a clock time in UTC and how far away it is.

`{{ value|when }}` → "6 Dec 02:38 UTC, in 14 min" (the year only when it is not
this year), in a <time> element whose relative part console.js keeps current.
`{{ seconds|duration }}` → "2 days", "15 min", "1 h 30 min": TTLs and windows in
human units instead of seconds.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

register = template.Library()

MINUTE = 60
HOUR = 60 * MINUTE
DAY = 24 * HOUR


def _plural(count: int, unit: str) -> str:
    return f"{count} {unit}{'' if count == 1 else 's'}"


def human_duration(seconds: float) -> str:
    """A length of time in the one or two largest units that matter."""
    seconds = abs(int(seconds))
    if seconds < MINUTE:
        return f"{seconds} s"
    if seconds < HOUR:
        return f"{seconds // MINUTE} min"
    if seconds < DAY:
        hours, minutes = divmod(seconds // MINUTE, 60)
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, rest = divmod(seconds, DAY)
    hours = rest // HOUR
    return _plural(days, "day") + (f" {hours} h" if hours and days < 7 else "")


def relative(moment: datetime, now: datetime) -> str:
    """ "in 14 min", "3 h 5 min ago", "just now" (within a minute either way)."""
    delta = (moment - now).total_seconds()
    if abs(delta) < MINUTE:
        return "just now"
    text = human_duration(delta)
    return f"in {text}" if delta > 0 else f"{text} ago"


def absolute(moment: datetime, now: datetime) -> str:
    """ "6 Dec 02:38 UTC"; the year is added when it is not the current one."""
    moment = moment.astimezone(UTC)
    year = f" {moment.year}" if moment.year != now.astimezone(UTC).year else ""
    return f"{moment.day} {moment:%b}{year} {moment:%H:%M} UTC"


@register.filter
def when(value: datetime | None) -> SafeString | str:
    """The date and time with its distance from now, e.g. "6 Dec 02:38 UTC, in 14 min"."""
    if not isinstance(value, datetime):
        return ""
    now = timezone.now()
    iso = value.astimezone(UTC).isoformat()
    return format_html(
        '<time datetime="{}" title="{}">{}</time>, <span data-relative="{}">{}</span>',
        iso,
        value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        absolute(value, now),
        iso,
        relative(value, now),
    )


@register.filter
def duration(value: Any) -> str:
    """Seconds as "2 days", "15 min", "1 h 30 min" ("" for None)."""
    if value is None or value == "":
        return ""
    return human_duration(float(value))


@register.filter
def since(value: datetime | None) -> SafeString | str:
    """Only the distance from now ("3 h 5 min ago"), kept current by console.js: next to
    an exact time that a list shows to the second (the audit trail)."""
    if not isinstance(value, datetime):
        return ""
    iso = value.astimezone(UTC).isoformat()
    return format_html('<span data-relative="{}">{}</span>', iso, relative(value, timezone.now()))
