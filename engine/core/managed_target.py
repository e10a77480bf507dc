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

`conditional_write` is the one conditional UPDATE of the store — the adapter's verbs, the
barrier's portable path and a create's revival of a tombstone (engine/core/barrier.py), and
undo (engine/core/undo.py) call it; `LAND_UPDATE` is the same statement keyed by id with
`RETURNING`, which engine/core/land.py fuses with the write's records into one statement on
PostgreSQL (the hot path: one round trip). The drain's batch UPDATE
(engine/core/batch_write.py) writes many rows from one `VALUES` list under the same rule and
stays a managed-only optimisation.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from engine.targets.base import (
    ABSENT,
    Capabilities,
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


# The fused single write's first statement (engine/core/land.py): an update or a delete.
LAND_UPDATE = update_statement(guard=LIVE, returning=" RETURNING id, version, document, deleted")


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

    capabilities = Capabilities(holds_fence=True, takes_idempotency_key=False)

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
                    Resource.objects.create(
                        kind_id=self.kind_id,
                        name=name,
                        document=document,
                        version=1,
                        last_fence=fence,
                        deleted=False,
                        owner_group=self.owner_group,
                    )
            except IntegrityError:
                return self._missed(name, fence, created=True)
            return WriteResult(Outcome.APPLIED, version="1")
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
            return WriteResult(Outcome.APPLIED, version=str(row["version"] + 1))
        return self._missed(name, fence, created=True)

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
        the fence first, as the barrier does (engine/core/barrier.py `classify_miss`)."""
        row = self._row(name)
        current = _snapshot(row)
        if created and current.exists:  # a live document: the create's twin won, or was there
            return WriteResult(Outcome.STALE, current=current, detail="already_exists")
        if row is not None and row["last_fence"] >= fence:
            detail = f"fence {fence} is stale: fence {row['last_fence']} has already written"
            return WriteResult(Outcome.FENCED, current=current, detail=detail)
        return WriteResult(Outcome.STALE, current=current, detail="" if current.exists else "gone")


def _snapshot(row: Mapping[str, Any] | None) -> Snapshot:
    if row is None or row["deleted"]:
        return ABSENT
    return Snapshot(row["document"], str(row["version"]))
