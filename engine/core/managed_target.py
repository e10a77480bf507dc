"""Airlock's own store as a target adapter (issue 39): one adapter among the others.

A managed kind's documents are rows of `ownership_resource`. Their version is the row's
integer counter written as text (`"41"`, the ETag's value), and the store holds the fence
itself: `last_fence` is the newest fence that wrote the row, and a write whose fence is not
newer is refused (`Outcome.FENCED`) — checked before the version, as the barrier always has
(a zombie holder must not write at all, and its refusal is not a conflict for a person).

Unlike the other adapters this one runs INSIDE the caller's database transaction, on
Django's connection: that is what makes a managed write atomic with Airlock's bookkeeping
(the `ResourceVersion` history row, the operation, the action's status and the audit event,
all written by the caller in the same transaction). The adapter writes the row and nothing
else. It takes no idempotency key: a replay is caught by the caller's operation row, locked
in the same transaction (a finished operation is answered from its record, never rewritten).

It lives in `engine/core`, not `engine/targets`: it needs the ORM and the connection, and
`engine/targets` imports no app and no Django by rule (tests/test_architecture.py).

`update_statement` is the one conditional UPDATE of the store; every write of it is one of
this adapter's methods. Beside the interface's verbs it offers what an adapter in the
caller's transaction may (`engine.targets.base.InTransactionTarget`): `write_carrying` — the
UPDATE with the caller's records (the history row, the operation done, the action applied)
as ONE statement, the barrier's single write on PostgreSQL (one round trip) — and
`write_many`, the drain's batch from one `VALUES` list under the same rule; and `restore`,
which puts back any state at a version, a tombstone too (undo of a delete revives it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from engine.targets.base import (
    ABSENT,
    Capabilities,
    Carried,
    CarriedResult,
    Held,
    ManyWrite,
    Outcome,
    Snapshot,
    WriteResult,
)
from ownership.models import Resource

_TABLE = Resource._meta.db_table

# Which rows a write may land on, beside the version and the fence: a live document (an
# update, a delete), a tombstone (a create reviving it), or either (undo restores a state).
LIVE = " AND NOT deleted"
TOMBSTONE = " AND deleted"
ANY_STATE = ""


_UPDATE = (
    "UPDATE {table} SET {document}, deleted = %s, version = version + 1, last_fence = %s, "
    "updated_at = %s WHERE id = %s AND version = %s{guard} AND last_fence < %s{returning}"
)


def update_statement(*, guard: str, keep_document: bool = False, returning: str = "") -> str:
    """The store's conditional UPDATE of one row by id. Parameters, in order: the document
    (absent when `keep_document`), the tombstone flag, the fence, the time, the row's id, the
    expected counter, the fence again. It writes only while the row is at the expected
    counter, matches `guard`, and has seen no fence as new as this one."""
    document = "document = document" if keep_document else "document = %s"
    # The table from the model's metadata, every other piece a constant; values are bound.
    return _UPDATE.format(table=_TABLE, document=document, guard=guard, returning=returning)


# `write_carrying`'s UPDATE: an update or a delete, returning the row as `Carried` names it.
_CARRYING_UPDATE = update_statement(
    guard=LIVE, returning=" RETURNING id, version, document, deleted"
)

# `restore`: any state (a tombstone too) at the version, by the kind and name.
_RESTORE_BY_NAME = (
    "UPDATE {table} SET document = %s, deleted = %s, version = version + 1, "
    "last_fence = %s, updated_at = %s "
    "WHERE kind_id = %s AND name = %s AND version = %s AND last_fence < %s"
)
_RESTORE = _RESTORE_BY_NAME.format(table=_TABLE)  # the table from the model's metadata

# `write_many`: each (id, expected counter, document, tombstone) of VALUES lands only where
# its row still matches; RETURNING names those that did.
_UPDATE_MANY = (
    "UPDATE {table} AS r "
    "SET document = v.document, deleted = v.deleted, version = r.version + 1, "
    "last_fence = %s, updated_at = %s "
    "FROM (VALUES {rows}) AS v (id, version, document, deleted) "
    "WHERE r.id = v.id AND r.version = v.version AND NOT r.deleted AND r.last_fence < %s "
    "RETURNING r.id"
)
_MANY_ROW = "(%s::bigint, %s::bigint, %s::jsonb, %s::boolean)"


def as_json(document: Any) -> Any:
    """A document as the connection's driver takes it for the jsonb column."""
    return Resource._meta.get_field("document").get_db_prep_value(document, connection)


def _as_time(now: datetime) -> Any:
    return Resource._meta.get_field("updated_at").get_db_prep_value(now, connection)


def conditional_write(
    resource_id: int,
    *,
    expected_version: int,
    document: Any,
    deleted: bool,
    fence: int,
    now: datetime,
    guard: str = LIVE,
    keep_document: bool = False,
) -> bool:
    """The one conditional UPDATE (one statement, the caller's transaction): True when the
    row was at `expected_version`, matched `guard` and `fence` was newer than its last one —
    the row then holds `document` (its own, with `keep_document`) at `expected_version + 1`
    with `last_fence = fence`. False: nothing was written; the caller classifies the miss."""
    params: list[Any] = [] if keep_document else [as_json(document)]
    params += [deleted, fence, _as_time(now), resource_id, expected_version, fence]
    sql = update_statement(guard=guard, keep_document=keep_document)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return bool(cursor.rowcount == 1)


def _counter(version: str) -> int | None:
    """The counter an opaque version names; None when no row can be at it."""
    if not (version.isascii() and version.isdecimal()) or str(int(version)) != version:
        return None  # compared exactly: "041" is not "41"
    return int(version)


class ManagedTarget:
    """The managed adapter of one kind (`TargetAdapter`): documents by name, versions as the
    counter's text. Call it inside a transaction of the default database."""

    capabilities = Capabilities(
        holds_fence=True, takes_idempotency_key=False, in_caller_transaction=True
    )

    def __init__(self, *, kind_id: str, owner_group: str) -> None:
        self.kind_id = kind_id
        self.owner_group = owner_group  # a created resource's owners: the kind's

    def _row(self, name: str) -> Mapping[str, Any] | None:
        return (
            Resource.objects.filter(kind_id=self.kind_id, name=name)
            .values("id", "document", "version", "deleted", "last_fence")
            .first()
        )

    def read(self, name: str) -> Snapshot:
        """The document and its version; ABSENT when there is no row or it is a tombstone."""
        return _snapshot(self._row(name))

    def write(
        self,
        name: str,
        document: Any,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        return self._update(name, document, False, expected_version=expected_version, fence=fence)

    def delete(
        self,
        name: str,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        """A tombstone: the row stays (versions keep rising, undo can revive it) and keeps
        its last document; readers see it absent."""
        return self._update(name, None, True, expected_version=expected_version, fence=fence)

    def create(
        self,
        name: str,
        document: Any,
        *,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        """An INSERT (the unique kind+name constraint refuses a concurrent twin: stale, with
        the twin), or the conditional revival of a tombstone at its counter."""
        row = self._row(name)
        if row is None:
            try:
                with transaction.atomic():  # a savepoint: a lost race leaves the caller's alive
                    created = Resource.objects.create(
                        kind_id=self.kind_id,
                        name=name,
                        document=document,
                        version=1,
                        last_fence=fence,
                        deleted=False,
                        owner_group=self.owner_group,
                    )
            except IntegrityError:
                missed = self._missed(name, fence, created=True)
                if missed.record_id is None:  # no twin: not a name clash, let it surface
                    raise
                return missed
            return WriteResult(Outcome.APPLIED, version="1", record_id=created.pk)
        if not row["deleted"]:
            return self._missed(name, fence, created=True)
        revived = conditional_write(
            row["id"],
            expected_version=row["version"],
            document=document,
            deleted=False,
            fence=fence,
            now=timezone.now(),
            guard=TOMBSTONE,
        )
        if revived:
            revived_at = str(row["version"] + 1)
            return WriteResult(Outcome.APPLIED, version=revived_at, record_id=row["id"])
        return self._missed(name, fence, created=True)

    def restore(
        self,
        name: str,
        document: Any,
        *,
        deleted: bool,
        on_version: str | None,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        """Any state at `on_version`, a tombstone too (the store keeps a tombstone's counter:
        the undo of a delete revives it at the tombstone's version) — one statement. APPLIED
        carries the version written, a tombstone's too."""
        expected = None if on_version is None else _counter(on_version)
        if expected is None:
            return self._missed(name, fence)
        params = [as_json(document), deleted, fence, _as_time(timezone.now())]
        params += [self.kind_id, name, expected, fence]
        with connection.cursor() as cursor:
            cursor.execute(_RESTORE, params)
            restored = cursor.rowcount == 1
        if restored:
            return WriteResult(Outcome.APPLIED, version=str(expected + 1))
        return self._missed(name, fence)

    def write_carrying(
        self,
        record_id: int,
        document: Any,
        *,
        expected_version: str,
        deleted: bool,
        fence: int,
        carried: Carried,
    ) -> CarriedResult:
        """The UPDATE and the caller's records as one statement of data-modifying CTEs (the
        records only when the UPDATE returned the row), and `carried.then` sent with it in
        psycopg's pipeline: one round trip. A miss is read back by id (one statement)."""
        expected = _counter(expected_version)
        assert expected is not None  # the caller's record holds this store's counter
        ctes = "".join(f", carried_{i} AS ({sql})" for i, (sql, _) in enumerate(carried.statements))
        # Constant pieces (the adapter's statement, the caller's constant statements); every
        # value is bound.
        sql = f"WITH written AS ({_CARRYING_UPDATE}){ctes} SELECT count(*) FROM written"  # noqa: S608
        params: list[Any] = [as_json(document), deleted, fence, _as_time(timezone.now())]
        params += [record_id, expected, fence]
        for _, statement_params in carried.statements:
            params += statement_params
        then_row: Any = None
        with connection.cursor() as cursor:
            if carried.then is None:
                cursor.execute(sql, params)
            else:
                with connection.wrap_database_errors, connection.cursor() as then:
                    with connection.connection.pipeline():
                        cursor.execute(sql, params)
                        then.execute(*carried.then)
                    then_row = then.fetchone()
            row = cursor.fetchone()
        if row and row[0] == 1:
            version = None if deleted else str(expected + 1)
            applied = WriteResult(Outcome.APPLIED, version=version, record_id=record_id)
            return CarriedResult(applied, then_row)
        return CarriedResult(self._missed_records([record_id], fence)[record_id], then_row)

    def write_many(self, writes: Sequence[ManyWrite], *, fence: int) -> dict[int, WriteResult]:
        """One UPDATE for all; the misses read back together. The rows go in id order, so
        that two overlapping batches (a zombie's and its successor's) whose plans look each
        row up by its key lock their common rows in the same order; a deadlock PostgreSQL
        still finds aborts one batch (the caller's transaction)."""
        if not writes:
            return {}
        params: list[Any] = [fence, _as_time(timezone.now())]
        for write in sorted(writes, key=lambda w: w.record_id):
            expected = _counter(write.expected_version)
            assert expected is not None  # the caller's record holds this store's counter
            params += [write.record_id, expected, as_json(write.document), write.deleted]
        params.append(fence)
        # The table from the model's metadata, one constant row per write; values are bound.
        sql = _UPDATE_MANY.format(table=_TABLE, rows=", ".join([_MANY_ROW] * len(writes)))
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            landed = {int(row[0]) for row in cursor.fetchall()}
        results = {
            w.record_id: WriteResult(
                Outcome.APPLIED,
                version=None if w.deleted else str(int(w.expected_version) + 1),
                record_id=w.record_id,
            )
            for w in writes
            if w.record_id in landed
        }
        missed = [w.record_id for w in writes if w.record_id not in landed]
        return {**results, **self._missed_records(missed, fence)}

    def _missed_records(self, record_ids: list[int], fence: int) -> dict[int, WriteResult]:
        """Misses of writes addressed by record: read back in one statement (a new
        statement sees the latest commit) and said why, the fence first."""
        if not record_ids:
            return {}
        rows = Resource.objects.filter(pk__in=record_ids).values(
            "id", "document", "version", "deleted", "last_fence"
        )
        return {row["id"]: _miss(row, fence) for row in rows}

    def _update(
        self, name: str, document: Any, deleting: bool, *, expected_version: str, fence: int
    ) -> WriteResult:
        """An update or a delete: the row's id by name, then the one statement."""
        expected = _counter(expected_version)
        row = self._row(name)
        if expected is None or row is None:
            return self._missed(name, fence)
        written = conditional_write(
            row["id"],
            expected_version=expected,
            document=document,
            deleted=deleting,
            fence=fence,
            now=timezone.now(),
            keep_document=deleting,
        )
        if written:
            return WriteResult(Outcome.APPLIED, version=None if deleting else str(expected + 1))
        return self._missed(name, fence)

    def _missed(self, name: str, fence: int, *, created: bool = False) -> WriteResult:
        """Nothing written: re-read (a new statement sees the latest commit) and say why —
        the fence first (`_miss`), as the barrier always has."""
        row = self._row(name)
        current = _snapshot(row)
        if created and current.exists:  # a live document: the create's twin won, or was there
            return WriteResult(
                Outcome.STALE,
                current=current,
                detail="already_exists",
                held=_held(row),
                record_id=row["id"] if row else None,
            )
        if row is None:
            return WriteResult(Outcome.STALE, current=current, detail="gone")
        return _miss(row, fence)


def _miss(row: Mapping[str, Any], fence: int) -> WriteResult:
    """Why a write on an existing row missed: a fence as new has written (checked first, as
    the barrier always has), else the version moved or the row is a tombstone."""
    current = _snapshot(row)
    if row["last_fence"] >= fence:
        detail = f"fence {fence} is stale: fence {row['last_fence']} has already written"
        outcome = Outcome.FENCED
    else:
        outcome, detail = Outcome.STALE, "" if current.exists else "gone"
    return WriteResult(
        outcome, current=current, detail=detail, held=_held(row), record_id=row["id"]
    )


def _held(row: Mapping[str, Any] | None) -> Held | None:
    if row is None:
        return None
    return Held(str(row["version"]), bool(row["deleted"]), int(row["last_fence"]))


def _snapshot(row: Mapping[str, Any] | None) -> Snapshot:
    if row is None or row["deleted"]:
        return ABSENT
    return Snapshot(row["document"], str(row["version"]))
