"""Notifications from the audit chain: the chain is the outbox, this is its reader.

Every event worth telling commits with the change it records (a decision, a write, a kill
switch): that is the promise an outbox makes, and the audit chain already keeps it. So
nothing is written for the notifications inside that transaction — which used to cost the
decision ≈ 5 ms under the audit head's lock (a listeners read, the event's facts, the
Notification and Delivery rows in a savepoint, an enqueue after commit), and every other
audited write waited behind it. Instead the `notify` process reads the chain after its
cursor, a few times a second (notifications/dispatcher.py), and for each event writes the
Notification and one Delivery per subscription that hears it, advancing the cursor in the
same transaction; the deliveries are enqueued after that commits.

Why nothing is lost or told twice:
- the head is the linker's (audit/linker.py): it moves to N only once every event up to N
  has committed or rolled back for good, so none below N can appear later. A pass links
  first (one pass of the linker, not waiting) so that it need not wait for the `audit`
  process's tick;
- the cursor row is locked (SKIP LOCKED) by the pass that advances it, and moves in the
  transaction that writes the rows: a pass killed midway rolls back and the next redoes it;
- each event's notification carries the dedupe key `audit:<seq>` (unique): even a cursor
  set back (restored from a backup) tells no event twice.

A subscription hears the events read after it exists; reading happens within about
AIRLOCK_NOTIFY_DISPATCH_SECONDS of the commit (and every few seconds from the cron's tick
should no notify process run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import connection, transaction

from audit.linker import audit_link
from audit.models import AuditEvent
from notifications.services.events import (
    AUDIT_TO_NOTIFICATION,
    event_notify,
    subscriptions_active,
)

log = logging.getLogger("airlock.notifications")

_EVENT_TYPES = sorted(AUDIT_TO_NOTIFICATION)
# The cursor, created at 0 where it is missing (a flushed test database; a new one gets it
# from the migration, at the head), then locked by a pass unless another holds it.
_CURSOR_ENSURE = """
INSERT INTO notifications_dispatchcursor (id, audit_seq, updated_at)
VALUES (1, 0, now()) ON CONFLICT (id) DO NOTHING
"""
_CURSOR_LOCK = """
SELECT audit_seq FROM notifications_dispatchcursor WHERE id = 1 FOR UPDATE SKIP LOCKED
"""
_HEAD = "SELECT seq FROM audit_audithead WHERE id = 1"
_CURSOR_MOVE = """
UPDATE notifications_dispatchcursor SET audit_seq = %s, updated_at = now() WHERE id = 1
"""
# Cheap enough to ask a few times a second: is there anything after the cursor?
_BEHIND = """
SELECT COALESCE((SELECT seq FROM audit_audithead WHERE id = 1), 0),
       (SELECT audit_seq FROM notifications_dispatchcursor WHERE id = 1)
"""


_LAG = """
SELECT COALESCE((SELECT max(seq) FROM audit_auditevent), 0),
       (SELECT audit_seq FROM notifications_dispatchcursor WHERE id = 1)
"""


@dataclass(frozen=True)
class DispatchPass:
    """What one pass did: events read (of the types that can be told), notifications
    written, and the cursor afterwards (None: another pass held it, nothing was done)."""

    read: int
    told: int
    cursor: int | None


def _position() -> tuple[int, int | None]:
    """The chain's committed head, and the cursor (None: no cursor row yet)."""
    with connection.cursor() as cursor:
        cursor.execute(_BEHIND)
        head, at = cursor.fetchone()
    return int(head), None if at is None else int(at)


def dispatch_lag() -> int:
    """How many audit events the notifications have not read yet (0 without PostgreSQL):
    counted to the newest committed event, linked or not (the linking is part of the wait)."""
    if connection.vendor != "postgresql":
        return 0
    with connection.cursor() as cursor:
        cursor.execute(_LAG)
        newest, at = cursor.fetchone()
    return max(0, int(newest) - int(at or 0))


def notifications_dispatch(*, limit: int = 500) -> DispatchPass:
    """Read the audit chain after the cursor, at most `limit` events that can be told, and
    write their notifications and deliveries; the cursor moves in the same transaction."""
    if connection.vendor != "postgresql":
        return DispatchPass(0, 0, None)  # the SQLite trial run (make run's default) tells no one
    audit_link(wait_seconds=0)
    head, at = _position()
    if at is None:
        # Created on its own, committed at once: inside the pass's transaction a second
        # pass's INSERT would wait on this one's until it committed, instead of skipping.
        with connection.cursor() as cursor:
            cursor.execute(_CURSOR_ENSURE)
    elif at >= head:
        return DispatchPass(0, 0, None)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(_CURSOR_LOCK)
            locked = cursor.fetchone()
            if locked is None:
                return DispatchPass(0, 0, None)  # another pass is reading
            cursor.execute(_HEAD)
            row = cursor.fetchone()
        at, head = int(locked[0]), int(row[0]) if row else 0
        events = list(
            AuditEvent.objects.filter(seq__gt=at, seq__lte=head, event_type__in=_EVENT_TYPES)
            .order_by("seq")
            .only("seq", "event_type", "resource", "run_id", "action_id", "details", "actor_label")[
                :limit
            ]
        )
        # A full batch moves the cursor to its last event (the rest come next pass); a short
        # one read everything up to the head.
        upto = events[-1].seq if len(events) == limit else head
        listeners = subscriptions_active() if events else []
        told = sum(1 for event in events if event_notify(event, listeners))
        with connection.cursor() as cursor:
            cursor.execute(_CURSOR_MOVE, [upto])
    if events:
        log.debug("notifications: read %d events up to #%d, told %d", len(events), upto, told)
    return DispatchPass(len(events), told, upto)


def notifications_dispatch_all(*, limit: int = 500) -> int:
    """Passes until the cursor reaches the head (or another pass holds it); events read."""
    read = 0
    while True:
        done = notifications_dispatch(limit=limit)
        read += done.read
        if done.cursor is None or done.read < limit:
            return read
