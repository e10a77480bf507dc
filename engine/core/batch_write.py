"""The drain's writes applied together: the batch's plain updates and deletes land with ONE
conditional write of many documents (`InTransactionTarget.write_many`: Airlock's store, one
UPDATE from a VALUES list) and are recorded with one statement per table
(barrier.record_applied), instead of four statements a write.

The rule is the barrier's (engine/core/barrier.py): a write lands only while its row is at
the observed version, not a tombstone, and its last fence is older than the batch's fence.
Every row the batch writes under was locked by lock_batch_rows in the caller's transaction.
A write that is not plain — a create, an operation already finished, an action no longer
executable, an ended run, a kill switch to look at again, a resource that does not exist —
goes through `apply_action` on its own, in proposal order, as before. A write the adapter
missed is refused on its own, from where the adapter found its resource.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from django.db import connection
from django.utils import timezone

from approvals.models import Action, Operation, OperationStatus, WriteOperation
from audit.services import Actor
from console.tracing import traced
from engine.core.barrier import (
    WriteOutcome,
    apply_action,
    in_transaction_target,
    planned_write,
    record_applied,
    record_refusal,
    refusal_of_miss,
)
from engine.core.land import Written
from engine.core.operations import EXECUTABLE_STATUSES
from engine.core.write_rows import NOT_READ, LockedRows, run_end_status
from engine.targets.base import InTransactionTarget, ManyWrite, WriteResult


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
    adapters: dict[str, InTransactionTarget] = {}  # one per kind
    for rows, _ in planned:
        if rows.action.kind_id not in adapters:
            adapters[rows.action.kind_id] = in_transaction_target(rows.action)
    targets = {
        w.resource_id: (rows.action.kind_id, adapters[rows.action.kind_id]) for rows, w in planned
    }
    results = _update_together([w for _, w in planned], targets=targets, fence=fence, now=now)
    outcomes: dict[uuid.UUID, WriteOutcome] = {}
    run: list[tuple[Action, Operation, Written]] = []
    for rows, written in planned:
        result = results[written.resource_id]
        if result.applied:
            run.append((rows.action, rows.operation, written))
            continue
        outcomes.update(_recorded(run, fence=fence, actor=actor, now=now))
        run = []
        assert written.base_version is not None
        refusal = refusal_of_miss(result, expected=written.base_version, fence=fence)
        outcomes[rows.action.pk] = record_refusal(
            rows.action, rows.operation, refusal, actor=actor, resource_id=written.resource_id
        )
    outcomes.update(_recorded(run, fence=fence, actor=actor, now=now))
    return outcomes


def _update_together(
    writes: list[Written],
    *,
    targets: dict[int, tuple[str, InTransactionTarget]],
    fence: int,
    now: datetime,
) -> dict[int, WriteResult]:
    """Each write's result by resource id: one `write_many` per kind (`targets`: each
    resource's kind and its adapter; a batch of one kind, the usual one, is one statement),
    the kinds in a fixed order so that two overlapping batches take their common rows'
    locks in the same order."""
    by_kind: dict[str, list[ManyWrite]] = {}
    for written in writes:
        assert written.base_version is not None  # an update or a delete observed a version
        many = ManyWrite(
            written.resource_id, str(written.base_version), written.document, written.deleted
        )
        by_kind.setdefault(targets[written.resource_id][0], []).append(many)
    adapters = dict(targets.values())
    results: dict[int, WriteResult] = {}
    for kind_id in sorted(by_kind):
        results.update(adapters[kind_id].write_many(by_kind[kind_id], fence=fence))
    return results


def _recorded(
    run: list[tuple[Action, Operation, Written]], *, fence: int, actor: Actor, now: datetime
) -> dict[uuid.UUID, WriteOutcome]:
    if not run:
        return {}
    outcomes = record_applied(run, fence=fence, actor=actor, now=now)
    return {outcome.action_id: outcome for outcome in outcomes}
