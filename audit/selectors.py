"""Reading the audit trail: filtered, keyset-paginated lists."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Q, QuerySet

from audit.models import ActorType, AuditEvent
from engine.core.errors import ValidationFailed

_MAX_LIMIT = 200


@dataclass(frozen=True)
class AuditPage:
    items: list[AuditEvent]
    next: str | None


def _invalid(name: str, message: str, detail: str) -> ValidationFailed:
    return ValidationFailed(detail, extra={"errors": [{"field": name, "message": message}]})


def _uuid(name: str, value: Any) -> uuid.UUID:
    try:
        return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
    except ValueError as exc:
        raise _invalid(name, "not a UUID", f"{name} must be a UUID") from exc


def _exact_or_prefix(field: str, value: Any) -> Q:
    text = str(value)
    return Q(**{f"{field}__startswith": text[:-1]}) if text.endswith("*") else Q(**{field: text})


def _by_agent(name: Any) -> Q:
    """The agent's own events and its runs' events, read from the events' own actor
    columns (audit imports no other app): an agent acts under its unique name, a run as
    `<agent>/<run id prefix>`, and every run's `run.created` names the agent or the run."""
    agent = Q(actor_type=ActorType.AGENT, actor_label=str(name))
    its_runs = Q(actor_type=ActorType.RUN, actor_label__startswith=f"{name}/")
    run_ids = AuditEvent.objects.filter(agent | its_runs, run_id__isnull=False).values("run_id")
    return agent | its_runs | Q(run_id__in=run_ids)


def _by_person(username: Any) -> Q | None:
    person = User.objects.filter(username=str(username)).first()
    if person is None:
        return None
    return Q(actor_type="person", actor_id=str(person.pk))


def _moment(name: str, value: Any) -> datetime:
    if not isinstance(value, datetime):
        raise _invalid(name, "not a date and time", f"{name} must be a date and time")
    return value


# Each filter name → the condition it adds (None: matches nothing).
_FILTERS: dict[str, Callable[[Any], Q | None]] = {
    "resource": lambda value: _exact_or_prefix("resource", value),
    "event_type": lambda value: _exact_or_prefix("event_type", value),
    "run": lambda value: Q(run_id=_uuid("run", value)),
    "action": lambda value: Q(action_id=_uuid("action", value)),
    "actor_type": lambda value: Q(actor_type=str(value)),
    "actor_id": lambda value: Q(actor_id=str(value)),
    "agent": _by_agent,
    "person": _by_person,
    "since": lambda value: Q(created_at__gte=_moment("since", value)),
    "until": lambda value: Q(created_at__lt=_moment("until", value)),
}


def audit_queryset(filters: Mapping[str, Any] | None = None) -> QuerySet[AuditEvent]:
    """Events matching `filters` (unknown keys and empty values ignored).

    resource, event_type: exact, or a prefix ending in `*` (e.g. `write.*`);
    run, action: UUIDs; actor_type, actor_id; agent: an agent's name (its own
    events and its runs'); person: a username; since, until: datetimes.
    """
    events = AuditEvent.objects.all()
    for name, value in (filters or {}).items():
        if value in (None, "") or name not in _FILTERS:
            continue
        condition = _FILTERS[name](value)
        if condition is None:
            return events.none()
        events = events.filter(condition)
    return events


def audit_list(
    *,
    filters: Mapping[str, Any] | None = None,
    cursor: str | None = None,
    limit: int = 50,
    newest_first: bool = True,
) -> AuditPage:
    """One page of events (newest first unless asked). The cursor is the opaque `next` of the
    previous page (keyset pagination on seq: stable while new events are appended).

    Who may read the trail is the caller's check (console.permissions.can_read_everything).
    Raises ValidationFailed for a bad cursor, limit or filter value.
    """
    if not 1 <= limit <= _MAX_LIMIT:
        raise _invalid("limit", "out of range", f"limit must be between 1 and {_MAX_LIMIT}")
    events = audit_queryset(filters)
    if cursor:
        try:
            after = int(cursor.removeprefix("s"))
        except ValueError as exc:
            raise _invalid("cursor", "invalid", "invalid cursor") from exc
        events = events.filter(seq__lt=after) if newest_first else events.filter(seq__gt=after)
    items = list(events.order_by("-seq" if newest_first else "seq")[: limit + 1])
    more = len(items) > limit
    items = items[:limit]
    return AuditPage(items=items, next=f"s{items[-1].seq}" if more and items else None)


def audit_event_types() -> list[str]:
    """Every event type the trail holds, sorted: the audit page's event-type list.

    A skip scan over the (event_type, seq) index (one index probe per distinct type), so
    it stays cheap on a trail of millions of events where a DISTINCT would read them all.
    """
    table = connection.ops.quote_name(AuditEvent._meta.db_table)
    sql = f"""
        WITH RECURSIVE types(event_type) AS (
            (SELECT event_type FROM {table} ORDER BY event_type LIMIT 1)
            UNION ALL
            SELECT (SELECT e.event_type FROM {table} e WHERE e.event_type > types.event_type
                    ORDER BY e.event_type LIMIT 1)
            FROM types WHERE types.event_type IS NOT NULL
        )
        SELECT event_type FROM types WHERE event_type IS NOT NULL
    """  # noqa: S608 - the table name is the model's own, quoted; no input reaches the SQL
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]
