"""Linking committed events into the chain, in seq order (PostgreSQL).

An append (audit/services.py) stores its event unlinked — `prev_hash` and `hash` empty, `seq`
drawn from a sequence — in the transaction of the change it records, and holds no lock to its
commit. The linker gives committed events, in seq order, their `prev_hash` (the hash before
them) and `hash`, and moves the head row to the last one: one transaction a pass, under the
head row's lock taken with SKIP LOCKED, so two linkers never fork the chain (the second
simply finds nothing to do).

The horizon: an event is linked only once no event with a lower seq can still commit.

1. `drawn`: the sequence's last value — every seq handed out so far, whether its transaction
   committed, rolled back or is still open. (The sequence keeps CACHE 1, as migration 0008
   makes it: with a cache, a session could hand out a seq below `drawn` later.)
2. Wait (briefly) until every transaction that may have drawn a seq up to `drawn` has ended,
   but this one (its own events are final to it). Then every event with seq ≤ `drawn` has
   committed (and this transaction's next statement sees it) or rolled back (and never
   will be): link them all, in seq order. A hole in the numbers is an append that rolled
   back. Two ways to know those transactions, each sound alone:
   - by transaction id: an append has a transaction id before it draws its seq
     (audit/services.py `_TRANSACTION_ID`), so each such transaction that is still open is
     one of this database's sessions showing a transaction id in `pg_stat_activity` read
     after (1) (an append to this database's table runs in a session of this database);
     settled once none of those sessions is still in that transaction. (Not a snapshot's
     `xmax`: it is one past the newest *ended* id, and an open transaction whose id is newer
     than every ended one is in progress without being listed in the snapshot — exactly an
     append that took its id after a transaction that drew a higher seq and committed
     first; `make bench` broke the chain that way.) pg_stat_activity takes no lock-manager
     lock;
   - by lock, precisely, when that wait is long (a long write transaction of this database
     that appends nothing): the transactions holding the events table's ROW EXCLUSIVE lock,
     read from `pg_locks` after (1) — an INSERT takes that lock before it draws its seq —
     settled once each has ended. `pg_locks` stops every lock acquisition while it is read:
     asked only then, and once.

A pass whose wait runs out (a long write transaction is open) links nothing and says so; the
next pass tries again. `audit_unlinked` tells how far behind the linking is, for verification,
/readyz and the console.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Min
from django.utils import timezone

from audit.chain import GENESIS_HASH, HASHED_COLUMNS, event_hash, hashed_fields
from audit.models import AuditEvent, AuditHead

_DRAWN = """
SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM audit_auditevent_seq
"""
# This database's other sessions in a transaction that has an id, read after `drawn`: every
# transaction that drew a seq up to `drawn` and may still commit is among them. (backend_xid
# is shown for every session, whatever this role may read of it.)
_OPEN_HERE = """
SELECT coalesce(array_agg(a.pid), '{}'), coalesce(array_agg(a.backend_xid::text), '{}')
FROM pg_stat_activity AS a
WHERE a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND a.pid <> pg_backend_pid() AND a.backend_xid IS NOT NULL
"""
# True once none of those sessions is still in that transaction (ids are never reused).
_ENDED_HERE = """
SELECT NOT EXISTS (
    SELECT FROM pg_stat_activity AS a
    JOIN unnest(%s::int[], %s::text[]) AS open(pid, xid)
      ON a.pid = open.pid AND a.backend_xid::text = open.xid
)
"""
# After this long waiting by transaction id, the precise wait by lock.
_BY_LOCK_AFTER_SECONDS = 0.1
# The other transactions that may be appending (or linking): the events table's writers.
_APPENDING = """
SELECT coalesce(array_agg(virtualtransaction), '{}') FROM pg_locks
WHERE locktype = 'relation' AND relation = 'audit_auditevent'::regclass
  AND mode = 'RowExclusiveLock' AND granted AND pid <> pg_backend_pid()
"""
# True once none of them holds it any more: each has ended.
_LOCKS_RELEASED = """
SELECT NOT EXISTS (
    SELECT FROM pg_locks WHERE locktype = 'relation'
       AND relation = 'audit_auditevent'::regclass AND virtualtransaction = ANY(%s)
)
"""
_LOCK_HEAD = "SELECT seq, hash FROM audit_audithead WHERE id = 1 FOR UPDATE SKIP LOCKED"
_LINK = """
UPDATE audit_auditevent AS e SET prev_hash = v.prev, hash = v.digest
FROM unnest(%s::bigint[], %s::text[], %s::text[]) AS v(seq, prev, digest)
WHERE e.seq = v.seq AND e.hash = ''
"""
_MOVE_HEAD = "UPDATE audit_audithead SET seq = %s, hash = %s WHERE id = 1"
_BATCH = 2000


@dataclass(frozen=True)
class LinkPass:
    """What one pass did: events linked, the head after it, and why it stopped short."""

    linked: int
    head_seq: int
    held_back: str = ""  # "": everything committed up to the horizon is linked


def audit_link(*, wait_seconds: float = 0.05) -> LinkPass:
    """Link every committed event up to the horizon (see the module's docstring)."""
    head_seq = _head_seq()
    if connection.vendor != "postgresql":  # appends are linked at once there
        return LinkPass(0, head_seq)
    with connection.cursor() as cursor:
        cursor.execute(_DRAWN)
        drawn = int(cursor.fetchone()[0])
        if drawn <= head_seq:
            return LinkPass(0, head_seq)
        if not _settled(cursor, wait_seconds):
            return LinkPass(0, head_seq, "a transaction older than the horizon is open")
    with transaction.atomic():
        return _link_up_to(drawn)


def _head_seq() -> int:
    seq = AuditHead.objects.filter(pk=1).values_list("seq", flat=True).first()
    return int(seq or 0)


def _settled(cursor: Any, wait_seconds: float) -> bool:
    """Has every transaction that may hold a seq up to the horizon ended (see the module)?
    By transaction id first; by lock, once, if that takes longer than a moment."""
    started = time.monotonic()
    _fresh_activity(cursor)
    cursor.execute(_OPEN_HERE)
    pids, xids = cursor.fetchone()
    if not pids:
        return True
    by_id = min(wait_seconds, _BY_LOCK_AFTER_SECONDS)
    if _waited(cursor, _ENDED_HERE, [list(pids), list(xids)], by_id, fresh=True):
        return True
    if wait_seconds <= _BY_LOCK_AFTER_SECONDS:  # a short pass (a reader's): the linker's next
        return False
    cursor.execute(_APPENDING)
    appending = list(cursor.fetchone()[0])
    if not appending:
        return True
    left = wait_seconds - (time.monotonic() - started)
    return _waited(cursor, _LOCKS_RELEASED, [appending], max(left, 0.0))


def _fresh_activity(cursor: Any) -> None:
    """pg_stat_activity is read once a transaction: inside one (a caller's), read it anew."""
    if connection.in_atomic_block:
        cursor.execute("SELECT pg_stat_clear_snapshot()")


def _waited(
    cursor: Any, check: str, params: list[Any], seconds: float, *, fresh: bool = False
) -> bool:
    """Ask `check` until it says true or `seconds` pass (at least once); `fresh`: it reads
    pg_stat_activity, read anew each time."""
    deadline = time.monotonic() + seconds
    pause = 0.001
    while True:
        if fresh:
            _fresh_activity(cursor)
        cursor.execute(check, params)
        if cursor.fetchone()[0]:
            return True
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _link_up_to(drawn: int) -> LinkPass:
    with connection.cursor() as cursor:
        cursor.execute(_LOCK_HEAD)
        row = cursor.fetchone()
        if row is None:
            if AuditHead.objects.filter(pk=1).exists():
                return LinkPass(0, _head_seq(), "another linker holds the head")
            # A flushed test database: the head starts again at the genesis.
            AuditHead.objects.get_or_create(pk=1, defaults={"seq": 0, "hash": GENESIS_HASH})
            cursor.execute(_LOCK_HEAD)
            row = cursor.fetchone()
        head_seq, head_hash = int(row[0]), str(row[1])
        linked, stop = 0, ""
        while not stop:
            rows = list(
                AuditEvent.objects.filter(seq__gt=head_seq, seq__lte=drawn)
                .order_by("seq")
                .values_list(*HASHED_COLUMNS, "hash")[:_BATCH]
            )
            if not rows:
                break
            seqs, prevs, digests = [], [], []
            for values in rows:
                if values[-1] != "":  # linked already, yet beyond the head: not ours to touch
                    stop = f"event #{values[0]} is linked beyond the head (#{head_seq})"
                    break
                fields = hashed_fields(**dict(zip(HASHED_COLUMNS, values[:-1], strict=True)))
                digest = event_hash(fields, head_hash)
                seqs.append(int(values[0]))
                prevs.append(head_hash)
                digests.append(digest)
                head_seq, head_hash = int(values[0]), digest
            if seqs:
                cursor.execute(_LINK, [seqs, prevs, digests])
                if cursor.rowcount != len(seqs):
                    raise RuntimeError("audit linker: an event changed while it was linked")
                linked += len(seqs)
            if len(rows) < _BATCH:
                break
        if linked:
            cursor.execute(_MOVE_HEAD, [head_seq, head_hash])
    return LinkPass(linked, head_seq, stop)


@dataclass(frozen=True)
class Unlinked:
    """The events committed and not linked yet: how many (up to the count's cap) and since when."""

    head_seq: int
    oldest: datetime | None

    def behind_seconds(self) -> float:
        if self.oldest is None:
            return 0.0
        return max(0.0, (timezone.now() - self.oldest).total_seconds())


def audit_unlinked() -> Unlinked:
    """How far the linking is behind: the head, and the oldest committed event past it (one
    statement: /metrics asks on every scrape). Events past the head are unlinked ones (or
    forged ones, which verification reports)."""
    with connection.cursor() as cursor:
        cursor.execute(_UNLINKED)
        row = cursor.fetchone()
    if row is None:  # no head row yet (a flushed test database): nothing is linked
        oldest = AuditEvent.objects.aggregate(oldest=Min("created_at"))["oldest"]
        return Unlinked(0, oldest)
    return Unlinked(int(row[0]), row[1])


_UNLINKED = """
SELECT h.seq, (SELECT min(e.created_at) FROM audit_auditevent e WHERE e.seq > h.seq)
FROM audit_audithead h WHERE h.id = 1
"""
