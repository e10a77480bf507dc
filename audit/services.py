"""Appending to the audit chain, and verifying it with a shared checkpoint.

Every service writes its audit event through `audit_append`, inside the same
transaction as the change it records. Appends are serialised on the AuditHead
row: the append locks it (by updating it) until the caller commits, so concurrent
writers never fork the chain and seq stays contiguous in commit order (a
rolled-back append rolls back the head too).

On PostgreSQL an append is ONE statement (see _APPEND) and opens no transaction
or savepoint of its own. `audit_append_many` (and the end of an `audit_deferred`
block) appends a batch in order as one statement a chunk (see _APPEND_MANY).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict, Unpack

from django.core.cache import cache
from django.db import connection, transaction
from django.utils import timezone
from redis.exceptions import RedisError

from audit.chain import (
    GENESIS_HASH,
    HASHED_COLUMNS,
    VerifyResult,
    canonical_json,
    event_hash,
    hashed_fields,
)
from audit.details import clean_details, storable
from audit.models import ActorType, AuditEvent, AuditHead
from audit.verify import audit_head, verify_chain
from console.advisory_locks import AUDIT_HEAD_QUEUE
from console.requestctx import current_request_id

logger = logging.getLogger(__name__)


# One round trip per append, and the head row touched once. The UPDATE locks the head
# (after waiting, PostgreSQL re-reads the latest committed head, so the chain cannot fork)
# and moves it in the same step: its SET expressions read the head as it was, so the new
# hash is PostgreSQL's sha256 over the canonical JSON that Python prepared with everything
# but `seq` and `prev_hash` (which come last in sorted-key order, so the text is
# `<prefix><seq>},"prev_hash":"<prev>"}` — the very bytes `audit.chain.event_hash`
# hashes), and the head keeps the hash it replaced in `prev_hash`, because RETURNING sees
# only the new row. The event is inserted from what the UPDATE returned. (A `SELECT … FOR
# UPDATE` then an UPDATE of the same row made 7 % fewer appends/s at 8 writers: the waiters
# re-read the row twice.)
#
# Writers queue for the head on a transaction-scoped advisory lock taken by the same
# statement just before it touches the row: PostgreSQL's lock manager hands that lock to one
# waiter at a time, where waiters on the row itself each wake at every commit to chase the
# row's new version. The row lock stays what keeps the chain whole; the queue only makes
# waiting cheap (8 writers: 2,127 to 2,218 -> 2,742 to 3,288 appends/s, the CPU an append
# 630 to 675 -> 415 to 495 µs). Every statement that locks the head takes it first (the batch
# append too), so the lock order is unchanged: the queue, then the head, last in a
# transaction.
HEAD_QUEUE_LOCK = (AUDIT_HEAD_QUEUE, 1)
_QUEUE = f"pg_advisory_xact_lock{HEAD_QUEUE_LOCK}"


def _digest_sql(prefix: str, seq: str, prev: str) -> str:
    """SQL for an event's hash: sha256 of `<prefix><seq>},"prev_hash":"<prev>"}`."""
    text = f"""{prefix} || {seq}::text || '}},"prev_hash":"' || {prev} || '"}}'"""
    return f"encode(sha256(convert_to({text}, 'UTF8')), 'hex')"


# The statement in two parts, so that audit_append_if can add its guard to the queue's WHERE:
# a guard that does not hold takes neither lock. Its placeholders: the guard's if any, the
# hashed prefix, then the columns.
_APPEND_HEAD = f"""
WITH queued AS MATERIALIZED (
    SELECT {_QUEUE} WHERE true"""
_APPEND_REST = f"""
), h AS (
    UPDATE audit_audithead
       SET seq = seq + 1, prev_hash = hash, hash = {_digest_sql("%s", "(seq + 1)", "hash")}
     WHERE id = 1 AND EXISTS (SELECT FROM queued)
    RETURNING seq, prev_hash AS prev, hash AS digest
), event AS (
    INSERT INTO audit_auditevent (seq, created_at, actor_type, actor_id, actor_label,
        request_id, event_type, resource, run_id, action_id, details, prev_hash, hash)
    SELECT seq, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, prev, digest FROM h
)
SELECT seq, prev, digest FROM h
"""  # noqa: S608 - constant fragments only (_digest_sql)
_APPEND = _APPEND_HEAD + _APPEND_REST
# What an append stores from the prepared event, in both statements' order: the columns the
# hash covers but seq (and prev_hash), which the statement itself gives.
_APPENDED_COLUMNS = HASHED_COLUMNS[1:]
_HASH_SUFFIX = '0},"prev_hash":""}'
# Several events in ONE statement, chained in order after the head: the recursive `chain`
# hashes each event over the one before it, exactly as _APPEND hashes one over the head.
# Its join finds the next event by its ordinal, a scan of the batch per event: batches
# go in chunks of _APPEND_MANY_CHUNK. The batch is ONE jsonb parameter (an array of
# objects: `prefix`, the _APPENDED_COLUMNS and `n`): eleven array parameters cost psycopg
# more to dump than the statement took to run (a 64-event chunk: 12 ms -> 7 ms).
_APPEND_MANY = f"""
WITH RECURSIVE queued AS MATERIALIZED (
    SELECT {_QUEUE}
), head AS (
    SELECT seq, hash FROM audit_audithead WHERE id = 1 AND EXISTS (SELECT FROM queued)
    FOR UPDATE
), item AS MATERIALIZED (
    SELECT * FROM jsonb_to_recordset(%s::jsonb) AS t(prefix text, created_at timestamptz,
        actor_type varchar, actor_id varchar, actor_label varchar, request_id varchar,
        event_type varchar, resource varchar, run_id uuid, action_id uuid, details jsonb,
        n int)
), chain AS (
    SELECT item.n, head.seq + 1 AS seq, head.hash::text AS prev,
        {_digest_sql("item.prefix", "(head.seq + 1)", "head.hash")} AS digest
    FROM head JOIN item ON item.n = 1
    UNION ALL
    SELECT item.n, chain.seq + 1, chain.digest,
        {_digest_sql("item.prefix", "(chain.seq + 1)", "chain.digest")}
    FROM chain JOIN item ON item.n = chain.n + 1
), event AS (
    INSERT INTO audit_auditevent (seq, created_at, actor_type, actor_id, actor_label,
        request_id, event_type, resource, run_id, action_id, details, prev_hash, hash)
    SELECT chain.seq, item.created_at, item.actor_type, item.actor_id, item.actor_label,
        item.request_id, item.event_type, item.resource, item.run_id, item.action_id,
        item.details, chain.prev, chain.digest
    FROM chain JOIN item ON item.n = chain.n
), moved AS (
    UPDATE audit_audithead SET seq = last.seq, hash = last.digest
    FROM (SELECT seq, digest FROM chain ORDER BY n DESC LIMIT 1) AS last
    WHERE audit_audithead.id = 1
)
SELECT seq, prev, digest FROM chain ORDER BY n
"""  # noqa: S608 - constant fragments only (_digest_sql)
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
    """Append one event to the chain, inside the caller's transaction.

    Locks the AuditHead row until the caller commits: keep it the last step
    of a transaction so the lock is held briefly.
    """
    prepared = _prepare(event)
    deferred = _DEFERRED.get()
    if deferred is not None:
        placeholder = _event(prepared, seq=0, prev_hash="", digest="")
        deferred.items.append((prepared, placeholder))
        return placeholder
    if connection.vendor != "postgresql":
        return _append_batch([prepared])[0]
    params = _append_params(prepared)
    # One statement is atomic by itself: no BEGIN/COMMIT round trips of our own
    # when the caller is in autocommit (inside its transaction it is simply the
    # transaction's last statement).
    row = _execute_append(params)
    if row is None:  # the head row is missing (a flushed test database)
        AuditHead.objects.get_or_create(pk=1, defaults={"seq": 0, "hash": GENESIS_HASH})
        row = _execute_append(params)
    assert row is not None
    return _event(prepared, seq=int(row[0]), prev_hash=str(row[1]), digest=str(row[2]))


@dataclass(frozen=True)
class GuardedAppend:
    """One append as a statement for the caller to send (see audit_append_if)."""

    sql: str
    params: list[Any]
    prepared: _Prepared

    def appended(self, row: Any) -> AuditEvent | None:
        """The event from the statement's row; None when nothing was appended (the guard
        did not hold, or the head row is missing: then call audit_append)."""
        if row is None:
            return None
        return _event(self.prepared, seq=int(row[0]), prev_hash=str(row[1]), digest=str(row[2]))


def audit_append_if(
    guard: str, guard_params: Sequence[Any], **event: Unpack[EventSpec]
) -> GuardedAppend | None:
    """audit_append as ONE statement that appends only if the SQL condition `guard` (its
    placeholders filled from `guard_params`) holds when it runs: for a caller that sends it
    in the same round trip as the statement it records (engine/core/land.py), so that a
    change that did not happen is not recorded. The same lock rule as audit_append; the
    head (its queue and its row) is locked only when the guard holds. None where an append
    is not one statement (inside audit_deferred, or not PostgreSQL): the caller calls
    audit_append."""
    if _DEFERRED.get() is not None or connection.vendor != "postgresql":
        return None
    prepared = _prepare(event)
    sql = f"{_APPEND_HEAD} AND ({guard}){_APPEND_REST}"
    return GuardedAppend(sql, [*guard_params, *_append_params(prepared)], prepared)


def _hash_prefix(prepared: _Prepared) -> str:
    """The hashed text up to seq (see _APPEND)."""
    template = canonical_json({"event": prepared.fields, "prev_hash": ""})
    if not template.endswith(_HASH_SUFFIX):  # the field set changed: fix _APPEND
        raise RuntimeError("audit hash layout is not <prefix><seq>},prev_hash")
    return template[: -len(_HASH_SUFFIX)]


def _append_params(prepared: _Prepared) -> list[Any]:
    """_APPEND's parameters: the hashed text up to seq, then the stored columns."""
    columns = prepared.columns
    return [
        _hash_prefix(prepared),
        *(columns[name] for name in _APPENDED_COLUMNS if name != "details"),
        json.dumps(columns["details"], ensure_ascii=False),
    ]


def _append_many_param(items: list[tuple[_Prepared, AuditEvent]]) -> str:
    """_APPEND_MANY's one parameter: the chunk as a JSON array, in order (`n` from 1)."""
    rows = [
        {
            **{name: prepared.columns[name] for name in _APPENDED_COLUMNS},
            "prefix": _hash_prefix(prepared),
            "n": n,
        }
        for n, (prepared, _) in enumerate(items, start=1)
    ]
    # str() of the two non-JSON column types is text PostgreSQL reads back as the same
    # value: the timestamp ("2026-12-02 10:31:00.123456+00:00") and the UUIDs. The details
    # are plain JSON already (clean_details).
    return json.dumps(rows, ensure_ascii=False, default=str)


def audit_append_many(events: Sequence[EventSpec]) -> list[AuditEvent]:
    """Append several events (each audit_append's keyword arguments), in order,
    with one head lock (one statement a chunk). Same locking rule as audit_append.
    """
    return _append_batch([_prepare(e) for e in events])


def _append_batch(prepared: list[_Prepared]) -> list[AuditEvent]:
    items = [(item, _event(item, seq=0, prev_hash="", digest="")) for item in prepared]
    _chain_and_insert(items)
    return [event for _, event in items]


def _chain_and_insert(items: list[tuple[_Prepared, AuditEvent]]) -> None:
    """Give each event its seq and hashes after the head (locked until commit), insert
    them all, move the head. On PostgreSQL one statement a chunk (_APPEND_MANY); else
    three statements, whatever the number of events."""
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
    params = [_append_many_param(items)]
    with connection.cursor() as cursor:
        cursor.execute(_APPEND_MANY, params)
        rows = cursor.fetchall()
        if not rows:  # the head row is missing (a flushed test database)
            AuditHead.objects.get_or_create(pk=1, defaults={"seq": 0, "hash": GENESIS_HASH})
            cursor.execute(_APPEND_MANY, params)
            rows = cursor.fetchall()
    assert len(rows) == len(items)
    for (_, event), (seq, prev_hash, digest) in zip(items, rows, strict=True):
        event.seq, event.prev_hash, event.hash = int(seq), str(prev_hash), str(digest)


def _execute_append(params: list[Any]) -> Any:
    # A server-side prepared statement (psycopg prepare=True) measured no faster
    # than Django's client-side binding here, so the Django cursor (with its
    # instrumentation) is kept.
    with connection.cursor() as cursor:
        cursor.execute(_APPEND, params)
        return cursor.fetchone()


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


def audit_chain_status(*, fresh: bool = False) -> ChainStatus:
    """The chain's state for the console's badge and GET /audit/verify.

    Walks only the events appended after the shared checkpoint; while the head
    has not moved the checkpoint is the answer (`fresh`: read the head and walk
    the tail anyway). A recorded break is the answer until a whole walk
    (`audit_chain_verify`) finds the chain whole. No checkpoint, one this chain
    does not extend, or a tail that does not verify: the whole walk decides.
    """
    broken = _load(BROKEN_KEY)
    if broken is not None:
        return broken if _in_this_chain(broken) else audit_chain_verify()
    checkpoint = _load(CHECKPOINT_KEY)
    if checkpoint is None:
        return audit_chain_verify()
    verified = (checkpoint.events, checkpoint.head_hash)
    head = audit_head()
    if head[0] < verified[0]:
        return audit_chain_verify()
    if head == verified and not fresh:
        return checkpoint
    tail = verify_chain(after=verified)
    if not tail.ok:
        return audit_chain_verify()
    status = _status(tail, full_walk_at=checkpoint.full_walk_at)
    _store(CHECKPOINT_KEY, status)
    return status


def audit_chain_verify(*, chunk_size: int = 2000) -> ChainStatus:
    """Walk the whole chain (`manage.py audit_verify`, the periodic job) and record
    the answer for every process: the checkpoint when whole, else the break.

    This is the walk that finds a change to events already verified: the badge
    and the API only walk what was appended since.
    """
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
