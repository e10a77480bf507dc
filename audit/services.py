"""Appending to the audit chain, and verifying it with a shared checkpoint.

Every service writes its audit event through `audit_append`, inside the same
transaction as the change it records: the event commits (or rolls back) with it.

On PostgreSQL an append is ONE INSERT (see _APPEND) that opens no transaction or
savepoint of its own and holds no lock: the event is stored unlinked, numbered by a
sequence, and the linker (audit/linker.py) chains committed events in seq order soon
after. `audit_append_many` (and the end of an `audit_deferred` block) appends a batch in
order as one statement a chunk (see _APPEND_MANY). On SQLite (one writer at a time) an
append is chained at once under the head row.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypedDict, Unpack

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.utils import timezone
from redis.exceptions import RedisError

from audit.chain import (
    GENESIS_HASH,
    HASHED_COLUMNS,
    VerifyResult,
    event_hash,
    hashed_fields,
)
from audit.details import clean_details, storable
from audit.linker import audit_link, audit_unlinked
from audit.models import ActorType, AuditEvent, AuditHead
from audit.verify import audit_head, verify_chain
from console.requestctx import current_request_id

logger = logging.getLogger(__name__)


# An append is ONE INSERT that takes its seq from a sequence and leaves the link empty: no
# lock is held until commit but the table's ROW EXCLUSIVE one, which every writer shares, so
# concurrent audited transactions commit side by side (their WAL flushes grouped by
# PostgreSQL) instead of one after another behind a head row held through every commit. The
# linker (audit/linker.py) later gives committed events, in seq order, their prev_hash and
# hash, and moves the head. Its horizon relies on two things every append does before it
# draws its seq: its transaction has an id (the sub-select, kept apart by OFFSET 0, is
# scanned before the outer projection calls nextval) and holds the table's lock (taken when
# the statement is parsed or its plan locked).
_UNLINKED_COLUMNS = """seq, created_at, actor_type, actor_id, actor_label, request_id,
        event_type, resource, run_id, action_id, details, prev_hash, hash"""
_TRANSACTION_ID = "(SELECT pg_current_xact_id() OFFSET 0) AS xid"
_APPEND_SELECT = f"""
INSERT INTO audit_auditevent ({_UNLINKED_COLUMNS})
SELECT nextval('audit_auditevent_seq'), %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, '', ''
FROM {_TRANSACTION_ID}"""  # noqa: S608 - constant fragments only
_RETURNING = "\nRETURNING seq"
_APPEND = _APPEND_SELECT + _RETURNING
# What an append stores from the prepared event, in the statements' order: the columns the
# hash covers but seq (and prev_hash), which the sequence and the linker give.
_APPENDED_COLUMNS = HASHED_COLUMNS[1:]
# Several events in ONE statement: the batch is ONE jsonb parameter (an array of objects,
# the _APPENDED_COLUMNS and `n`; eleven array parameters cost psycopg more to dump than the
# statement took to run), sorted by `n` in a sub-select so that nextval, called by the outer
# projection, numbers them in the caller's order.
_APPEND_MANY = f"""
INSERT INTO audit_auditevent ({_UNLINKED_COLUMNS})
SELECT nextval('audit_auditevent_seq'), item.created_at, item.actor_type, item.actor_id,
    item.actor_label, item.request_id, item.event_type, item.resource, item.run_id,
    item.action_id, item.details, '', ''
FROM {_TRANSACTION_ID}, (
    SELECT * FROM jsonb_to_recordset(%s::jsonb) AS t(created_at timestamptz,
        actor_type varchar, actor_id varchar, actor_label varchar, request_id varchar,
        event_type varchar, resource varchar, run_id uuid, action_id uuid, details jsonb,
        n int)
    ORDER BY n OFFSET 0
) AS item
RETURNING seq
"""  # noqa: S608 - constant fragments only
_APPEND_MANY_CHUNK = 64


@dataclass(frozen=True)
class Actor:
    """Who did it: a person, an agent, a run or the system."""

    type: str
    id: str = ""
    label: str = ""

    @classmethod
    def system(cls, label: str = "airlock") -> Actor:
        return cls(ActorType.SYSTEM, "", label)

    @classmethod
    def person(cls, user: Any) -> Actor:
        return cls(ActorType.PERSON, str(user.pk), user.get_username())

    @classmethod
    def agent(cls, agent: Any) -> Actor:
        return cls(ActorType.AGENT, str(agent.pk), agent.name)

    @classmethod
    def run(cls, run: Any) -> Actor:
        return cls(ActorType.RUN, str(run.pk), f"{run.agent.name}/{str(run.pk)[:8]}")


class _EventRequired(TypedDict):
    event_type: str
    actor: Actor


class EventSpec(_EventRequired, total=False):
    """One event, as audit_append's keyword arguments."""

    resource: str
    run_id: uuid.UUID | str | None
    action_id: uuid.UUID | str | None
    details: dict[str, Any] | None
    request_id: str | None


def _as_uuid(value: uuid.UUID | str | None) -> uuid.UUID | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


@dataclass(frozen=True)
class _Prepared:
    """One event's stored columns, and its hashed fields with seq left at 0."""

    columns: dict[str, Any]
    fields: dict[str, Any]


_EVENT_KEYS = EventSpec.__required_keys__ | EventSpec.__optional_keys__


def _prepare(event: EventSpec) -> _Prepared:
    unknown = event.keys() - _EVENT_KEYS
    if unknown:  # untyped callers (tests, bench) get what a keyword-only signature gave
        raise TypeError(f"audit_append() got unexpected keyword arguments {sorted(unknown)}")
    actor = event["actor"]
    request_id = event.get("request_id")
    rid = request_id if request_id is not None else current_request_id()
    # Cleaned and clipped to the column limits before hashing, so the hash
    # covers exactly what is stored.
    columns: dict[str, Any] = {
        "created_at": timezone.now(),
        "actor_type": actor.type,
        "actor_id": storable(actor.id)[:64],
        "actor_label": storable(actor.label)[:200],
        "request_id": storable(rid)[:128],
        "event_type": storable(event["event_type"])[:64],
        "resource": storable(event.get("resource", ""))[:320],
        "run_id": _as_uuid(event.get("run_id")),
        "action_id": _as_uuid(event.get("action_id")),
        "details": clean_details(event.get("details")),
    }
    return _Prepared(columns, hashed_fields(seq=0, **columns))


def _event(prepared: _Prepared, *, seq: int, prev_hash: str, digest: str) -> AuditEvent:
    event = AuditEvent(seq=seq, prev_hash=prev_hash, hash=digest, **prepared.columns)
    event._state.adding = False
    event._state.db = "default"
    return event


class DeferredAppends:
    """The events `audit_deferred` holds back, in order, until its block ends."""

    def __init__(self) -> None:
        self.items: list[tuple[_Prepared, AuditEvent]] = []

    def mark(self) -> int:
        """Where the events of a savepoint about to open begin."""
        return len(self.items)

    def discard_after(self, mark: int) -> None:
        """The savepoint opened at `mark` rolled back: its events never happened."""
        del self.items[mark:]


_DEFERRED: ContextVar[DeferredAppends | None] = ContextVar("audit_deferred", default=None)


@contextmanager
def audit_deferred() -> Iterator[DeferredAppends]:
    """Inside a transaction that records many changes (the drain's batch): every
    audit_append in the block holds its event back, and the block's end appends them
    all, in order, under ONE head lock — one contiguous run of the chain, one INSERT.

    The head is then locked once, after every row lock of the batch (the lock order:
    the audit head last), instead of from the first change to the commit. The events
    returned inside the block get their seq and hashes when it ends. A savepoint that
    rolls back inside the block must drop its events (`mark` / `discard_after`). A block
    inside another joins it: the outer block's end appends both's events, in call order.
    """
    if not connection.in_atomic_block:
        raise RuntimeError("audit_deferred() needs the caller's transaction")
    outer = _DEFERRED.get()
    if outer is not None:
        # Inside another block (a service that defers, called by one that defers too): its
        # events join the outer block's, so the chain keeps call order and the head is still
        # locked once, at the outer end. A block that fails drops its own events, as ending
        # it would have.
        mark = outer.mark()
        try:
            yield outer
        except BaseException:
            outer.discard_after(mark)
            raise
        return
    held = DeferredAppends()
    token = _DEFERRED.set(held)
    try:
        yield held
    finally:
        _DEFERRED.reset(token)
    _chain_and_insert(held.items)


def audit_append(**event: Unpack[EventSpec]) -> AuditEvent:
    """Append one event, inside the caller's transaction: it commits (or rolls back) with
    the change it records. On PostgreSQL the event is stored unlinked (one INSERT, no lock)
    and the linker chains it after it commits (audit/linker.py); elsewhere it is chained
    at once under the head row's lock."""
    prepared = _prepare(event)
    deferred = _DEFERRED.get()
    if deferred is not None:
        placeholder = _event(prepared, seq=0, prev_hash="", digest="")
        deferred.items.append((prepared, placeholder))
        return placeholder
    if connection.vendor != "postgresql":
        return _append_batch([prepared])[0]
    # One statement is atomic by itself: no BEGIN/COMMIT round trips of our own when the
    # caller is in autocommit (inside its transaction it is one more statement).
    with connection.cursor() as cursor:
        cursor.execute(_APPEND, _append_params(prepared))
        row = cursor.fetchone()
    return _event(prepared, seq=int(row[0]), prev_hash="", digest="")


@dataclass(frozen=True)
class GuardedAppend:
    """One append as a statement for the caller to send (see audit_append_if)."""

    sql: str
    params: list[Any]
    prepared: _Prepared

    def appended(self, row: Any) -> AuditEvent | None:
        """The event from the statement's row; None when the guard did not hold."""
        if row is None:
            return None
        return _event(self.prepared, seq=int(row[0]), prev_hash="", digest="")


def audit_append_if(
    guard: str, guard_params: Sequence[Any], **event: Unpack[EventSpec]
) -> GuardedAppend | None:
    """audit_append as ONE statement that appends only if the SQL condition `guard` (its
    placeholders filled from `guard_params`) holds when it runs: for a caller that sends it
    in the same round trip as the statement it records (engine/core/land.py), so that a
    change that did not happen is not recorded (and draws no seq). None where an append
    is not one statement (inside audit_deferred, or not PostgreSQL): the caller calls
    audit_append."""
    if _DEFERRED.get() is not None or connection.vendor != "postgresql":
        return None
    prepared = _prepare(event)
    sql = f"{_APPEND_SELECT}\nWHERE ({guard}){_RETURNING}"
    return GuardedAppend(sql, [*_append_params(prepared), *guard_params], prepared)


def _append_params(prepared: _Prepared) -> list[Any]:
    """_APPEND's parameters: the stored columns, in its order."""
    columns = prepared.columns
    return [
        *(columns[name] for name in _APPENDED_COLUMNS if name != "details"),
        json.dumps(columns["details"], ensure_ascii=False),
    ]


def _append_many_param(items: list[tuple[_Prepared, AuditEvent]]) -> str:
    """_APPEND_MANY's one parameter: the chunk as a JSON array, in order (`n` from 1)."""
    rows = [
        {**{name: prepared.columns[name] for name in _APPENDED_COLUMNS}, "n": n}
        for n, (prepared, _) in enumerate(items, start=1)
    ]
    # str() of the two non-JSON column types is text PostgreSQL reads back as the same
    # value: the timestamp ("2026-12-02 10:31:00.123456+00:00") and the UUIDs. The details
    # are plain JSON already (clean_details).
    return json.dumps(rows, ensure_ascii=False, default=str)


def audit_append_many(events: Sequence[EventSpec]) -> list[AuditEvent]:
    """Append several events (each audit_append's keyword arguments), in order: one
    statement a chunk on PostgreSQL. Same rule as audit_append."""
    return _append_batch([_prepare(e) for e in events])


def _append_batch(prepared: list[_Prepared]) -> list[AuditEvent]:
    items = [(item, _event(item, seq=0, prev_hash="", digest="")) for item in prepared]
    _chain_and_insert(items)
    return [event for _, event in items]


def _chain_and_insert(items: list[tuple[_Prepared, AuditEvent]]) -> None:
    """Store the events in order. On PostgreSQL unlinked, numbered by the sequence (one
    statement a chunk); elsewhere (SQLite, one writer at a time) chained at once after the
    head, under its row lock, in three statements whatever the number of events."""
    if not items:
        return
    if connection.vendor == "postgresql":
        for start in range(0, len(items), _APPEND_MANY_CHUNK):
            _append_chunk(items[start : start + _APPEND_MANY_CHUNK])
        return
    with transaction.atomic(savepoint=False):
        head = AuditHead.objects.select_for_update().filter(pk=1).first()
        if head is None:
            head = AuditHead.objects.create(pk=1, seq=0, hash=GENESIS_HASH)
        seq, prev_hash = head.seq, head.hash
        for prepared, event in items:
            seq += 1
            digest = event_hash({**prepared.fields, "seq": seq}, prev_hash)
            event.seq, event.prev_hash, event.hash = seq, prev_hash, digest
            prev_hash = digest
        AuditEvent.objects.bulk_create([event for _, event in items])
        AuditHead.objects.filter(pk=1).update(seq=seq, hash=prev_hash)


def _append_chunk(items: list[tuple[_Prepared, AuditEvent]]) -> None:
    with connection.cursor() as cursor:
        cursor.execute(_APPEND_MANY, [_append_many_param(items)])
        rows = cursor.fetchall()
    assert len(rows) == len(items)
    # nextval numbered the events in the chunk's order, so ascending seq is that order.
    for (_, event), seq in zip(items, sorted(int(row[0]) for row in rows), strict=True):
        event.seq = seq


# --- Verification: one walk, one checkpoint shared by every process ------------------
#
# The checkpoint (the last verified seq and hash) lives in Django's cache, which
# is Redis: every web process and worker reads and moves the same one. Losing it
# (a Redis restart or FLUSHALL) costs one walk from the start. A break, once
# found, is kept under its own key so that a concurrent tail walk can never
# overwrite it; only a whole walk that finds the chain whole again clears it.

CHECKPOINT_KEY = "airlock:audit:verify:checkpoint"
BROKEN_KEY = "airlock:audit:verify:broken"


@dataclass(frozen=True)
class ChainStatus:
    """The chain as last verified. `events`/`head_hash`: the verified prefix;
    `walked`: rows read to give this answer (0 when it came from the checkpoint)."""

    ok: bool
    events: int
    first_bad_seq: int | None
    head_hash: str
    problem: str
    checked_at: datetime
    full_walk_at: datetime | None
    walked: int = 0
    cached: bool = False
    linked_seq: int = 0  # the head: every committed event up to it is linked
    behind_seconds: float = 0.0  # how long the oldest committed, unlinked event has waited
    lagging: bool = False  # whole, but an event has waited past the bound to be linked


_STORED = ("ok", "events", "first_bad_seq", "head_hash", "problem", "checked_at", "full_walk_at")


def _status(result: VerifyResult, *, full_walk_at: datetime | None) -> ChainStatus:
    return ChainStatus(
        ok=result.ok,
        events=result.events,
        first_bad_seq=result.first_bad_seq,
        head_hash=result.head_hash,
        problem=result.problem,
        checked_at=timezone.now(),
        full_walk_at=full_walk_at,
        walked=result.walked,
    )


def _load(key: str) -> ChainStatus | None:
    try:
        stored = cache.get(key)
    except RedisError:
        logger.warning("audit verify: the checkpoint cache is unreachable", exc_info=True)
        return None
    if not isinstance(stored, dict):
        return None
    try:
        return ChainStatus(**{name: stored[name] for name in _STORED}, cached=True)
    except (KeyError, TypeError):  # written by an older version: walk again
        return None


def _store(key: str, status: ChainStatus) -> None:
    try:
        cache.set(key, {name: getattr(status, name) for name in _STORED}, timeout=None)
    except RedisError:
        logger.warning("audit verify: the checkpoint cache is unreachable", exc_info=True)


def _forget(key: str) -> None:
    try:
        cache.delete(key)
    except RedisError:
        logger.warning("audit verify: the checkpoint cache is unreachable", exc_info=True)


def _in_this_chain(status: ChainStatus) -> bool:
    """Does this database still hold the status's last verified event? (Redis may
    be shared with another database, or kept while the database was restored.)"""
    if status.events == 0:
        return True
    return AuditEvent.objects.filter(seq=status.events, hash=status.head_hash).exists()


def _with_linking(status: ChainStatus) -> ChainStatus:
    """The status, and the chain reported behind when a committed event has waited longer
    than the bound to be linked (the answer of this moment: never stored)."""
    waiting = audit_unlinked()
    behind = waiting.behind_seconds()
    status = replace(status, linked_seq=waiting.head_seq, behind_seconds=round(behind, 3))
    if not status.ok or behind <= settings.AIRLOCK_AUDIT_LINK_BOUND_SECONDS:
        return status
    return replace(
        status,
        ok=False,
        lagging=True,
        first_bad_seq=waiting.head_seq + 1,
        problem=f"linking is {behind:.1f} s behind: events past #{waiting.head_seq} wait "
        "to be linked (is the `audit` process running? is a write transaction held open?)",
    )


def audit_chain_status(*, fresh: bool = False) -> ChainStatus:
    """The chain's state for the console's badge and GET /audit/verify: what is committed
    is linked first (one pass of the linker), then verified as below."""
    audit_link()
    return _with_linking(_chain_status(fresh=fresh))


def _chain_status(*, fresh: bool = False) -> ChainStatus:
    """The chain's state for the console's badge and GET /audit/verify.

    Walks only the events appended after the shared checkpoint; while the head
    has not moved the checkpoint is the answer (`fresh`: read the head and walk
    the tail anyway). A recorded break is the answer until a whole walk
    (`audit_chain_verify`) finds the chain whole. No checkpoint, one this chain
    does not extend, or a tail that does not verify: the whole walk decides.
    """
    broken = _load(BROKEN_KEY)
    if broken is not None:
        return broken if _in_this_chain(broken) else _chain_verify()
    checkpoint = _load(CHECKPOINT_KEY)
    if checkpoint is None:
        return _chain_verify()
    verified = (checkpoint.events, checkpoint.head_hash)
    head = audit_head()
    if head[0] < verified[0]:
        return _chain_verify()
    if head == verified and not fresh:
        return checkpoint
    tail = verify_chain(after=verified)
    if not tail.ok:
        return _chain_verify()
    status = _status(tail, full_walk_at=checkpoint.full_walk_at)
    _store(CHECKPOINT_KEY, status)
    return status


def audit_chain_verify(*, chunk_size: int = 2000) -> ChainStatus:
    """Link what is committed, walk the whole chain (`manage.py audit_verify`, the
    periodic job) and record the answer for every process: the checkpoint when whole,
    else the break.

    This is the walk that finds a change to events already verified: the badge
    and the API only walk what was appended since.
    """
    audit_link()
    return _with_linking(_chain_verify(chunk_size=chunk_size))


def _chain_verify(*, chunk_size: int = 2000) -> ChainStatus:
    status = _status(verify_chain(chunk_size=chunk_size), full_walk_at=timezone.now())
    if not status.ok:
        _store(BROKEN_KEY, status)
        return status
    _store(CHECKPOINT_KEY, status)
    known = _load(BROKEN_KEY)
    # Keep a break found further along by a walk that started later than this one.
    found_later = known is not None and (known.first_bad_seq or 0) > status.events
    if known is not None and not (found_later and _in_this_chain(known)):
        _forget(BROKEN_KEY)
    return status


def audit_chain_last_known() -> ChainStatus | None:
    """The chain's last recorded answer (a break, else the checkpoint) without walking any
    event: for /metrics, whose scrape must stay cheap whatever the chain's length. None
    when nothing is recorded (Redis lost it; the next badge, API call or hourly walk
    records one)."""
    broken = _load(BROKEN_KEY)
    return broken if broken is not None else _load(CHECKPOINT_KEY)
