"""The drain's writes applied together: the batch's plain updates and deletes land with ONE
conditional UPDATE and are recorded with one statement per table (barrier.record_applied),
instead of four statements a write.

The rule is the barrier's (engine/core/barrier.py): a write lands only while its row is at
the observed version, not a tombstone, and its last fence is older than the batch's fence.
Every row the batch writes under was locked by lock_batch_rows in the caller's transaction.
A write that is not plain — a create, an operation already finished, an action no longer
executable, an ended run, a kill switch to look at again, a resource that does not exist —
goes through `apply_action` on its own, in proposal order, as before. A write the UPDATE
missed is classified and refused on its own (a re-read), as a single write's miss is.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import connection
from django.utils import timezone

from approvals.models import Action, Operation, OperationStatus, WriteOperation
from audit.services import Actor
from console.tracing import traced
from engine.core.barrier import (
    WriteOutcome,
    apply_action,
    classify_miss,
    planned_write,
    record_applied,
    record_refusal,
)
from engine.core.land import Written
from engine.core.operations import EXECUTABLE_STATUSES
from engine.core.write_rows import NOT_READ, LockedRows, run_end_status
from ownership.models import Resource

# The barrier's conditional UPDATE for many rows: each (id, observed version, document,
# tombstone) of VALUES lands only where the row still matches; RETURNING names those that did.
_UPDATE_TOGETHER = """
UPDATE ownership_resource AS r
   SET document = v.document, deleted = v.deleted, version = r.version + 1,
       last_fence = %s, updated_at = %s
  FROM (VALUES {rows}) AS v (id, version, document, deleted)
 WHERE r.id = v.id AND r.version = v.version AND NOT r.deleted AND r.last_fence < %s
RETURNING r.id
"""
_ROW = "(%s::bigint, %s::bigint, %s::jsonb, %s::boolean)"


@traced("airlock.barrier")
def apply_locked_batch(
    writes: Sequence[LockedRows], *, fence: int, actor: Actor
) -> dict[uuid.UUID, WriteOutcome]:
    """Apply the batch's writes (rows locked, caller's transaction, no savepoints: an error
    dooms the caller's transaction, which redoes the batch a write at a time)."""
    now = timezone.now()
    outcomes: dict[uuid.UUID, WriteOutcome] = {}
    plain: list[LockedRows] = []
    for rows in writes:
        if connection.vendor == "postgresql" and _is_plain(rows, now):
            plain.append(rows)
            continue
        outcomes.update(_apply_together(plain, fence=fence, actor=actor, now=now))
        plain = []
        outcomes[rows.action.pk] = apply_action(
            action_id=rows.action.pk,
            operation_id=rows.operation.pk,
            fence=fence,
            actor=actor,
            locked=rows,
            savepoint=False,
        )
    outcomes.update(_apply_together(plain, fence=fence, actor=actor, now=now))
    return outcomes


def _is_plain(rows: LockedRows, now: datetime) -> bool:
    """An update or delete of an existing resource that nothing stops but its version."""
    action = rows.action
    return (
        rows.operation.status == OperationStatus.PENDING
        and rows.switches_clear
        and action.status in EXECUTABLE_STATUSES
        and action.operation != WriteOperation.CREATE
        and rows.resource is not NOT_READ
        and rows.resource is not None
        and run_end_status(action, rows.run_state, now=now) is None
    )


def _apply_together(
    plain: list[LockedRows], *, fence: int, actor: Actor, now: datetime
) -> dict[uuid.UUID, WriteOutcome]:
    """One UPDATE for all; then, in proposal order, each run of writes that landed is
    recorded together and each miss is refused on its own (the audit events stay in order)."""
    if not plain:
        return {}
    planned = [(rows, planned_write(rows.action, rows.resource)) for rows in plain]
    landed = _update_together([written for _, written in planned], fence=fence, now=now)
    outcomes: dict[uuid.UUID, WriteOutcome] = {}
    run: list[tuple[Action, Operation, Written]] = []
    for rows, written in planned:
        if written.resource_id in landed:
            run.append((rows.action, rows.operation, written))
            continue
        outcomes.update(_recorded(run, fence=fence, actor=actor, now=now))
        run = []
        assert written.base_version is not None
        refusal = classify_miss(written.resource_id, expected=written.base_version, fence=fence)
        outcomes[rows.action.pk] = record_refusal(
            rows.action, rows.operation, refusal, actor=actor, resource_id=written.resource_id
        )
    outcomes.update(_recorded(run, fence=fence, actor=actor, now=now))
    return outcomes


def _update_together(writes: list[Written], *, fence: int, now: datetime) -> set[int]:
    """The resource ids the one conditional UPDATE wrote. The rows go in id order, so that
    two overlapping batches (a zombie's and its successor's) whose plans look each row up by
    its key lock their common rows in the same order; a deadlock PostgreSQL still finds
    aborts one batch, which is then redone a write at a time."""
    as_json = Resource._meta.get_field("document").get_db_prep_value
    params: list[Any] = [fence, now]
    for written in sorted(writes, key=lambda w: w.resource_id):
        document = as_json(written.document, connection)
        params += [written.resource_id, written.base_version, document, written.deleted]
    params.append(fence)
    sql = _UPDATE_TOGETHER.format(rows=", ".join([_ROW] * len(writes)))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {int(row[0]) for row in cursor.fetchall()}


def _recorded(
    run: list[tuple[Action, Operation, Written]], *, fence: int, actor: Actor, now: datetime
) -> dict[uuid.UUID, WriteOutcome]:
    if not run:
        return {}
    outcomes = record_applied(run, fence=fence, actor=actor, now=now)
    return {outcome.action_id: outcome for outcome in outcomes}
