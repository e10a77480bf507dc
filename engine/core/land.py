"""A single update or delete landing in ONE round trip (PostgreSQL), through the kind's
adapter (`InTransactionTarget.write_carrying`).

The barrier hands the adapter what records the write — the new ResourceVersion (read from
the row the write returns, `written`), the operation `done`, the action `applied` — as
statements the adapter runs with its conditional write, only if it lands: Airlock's store
makes them one statement of data-modifying CTEs behind its own UPDATE, so a miss changes
nothing and is classified from what the adapter read back. The operation and action rows
are already locked by this transaction (engine/core/write_rows.py), so the statement takes
no lock the one lock order does not already hold, except the resource row's, which the
UPDATE takes first. The audit event stays a statement of its own (an INSERT guarded by the
operation being `done`), run after the write but sent with it (`Carried.then`): one round
trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from audit.services import EventSpec, audit_append, audit_append_if
from engine.targets.base import Carried, InTransactionTarget, WriteResult

# The write's records, each written only if the write returned its row (`written`).
_HISTORY = """
    INSERT INTO ownership_resourceversion (resource_id, version, document, deleted, operation,
        fence, run_id, action_id, person_id, created_at)
    SELECT id, version, document, deleted, %s, %s, %s, %s, NULL, %s FROM written
"""
_OPERATION_DONE = """
    UPDATE approvals_operation
       SET status = %s, fence = %s, base_version = %s, result_version = %s,
           undo_deadline = %s, finished_at = %s, outcome = %s
     WHERE id = %s AND EXISTS (SELECT 1 FROM written)
"""
_ACTION_APPLIED = """
    UPDATE approvals_action
       SET status = %s, revision = revision + 1, resource_id = %s, error = NULL,
           updated_at = %s
     WHERE id = %s AND EXISTS (SELECT 1 FROM written)
"""


def undo_window(action: Action) -> timedelta:
    kind_window = action.kind.undo_window_seconds
    seconds = kind_window if kind_window is not None else action.conflict_class.undo_window_seconds
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class Written:
    """A write that landed: the resource row now holds `document` at `result_version`."""

    resource_id: int
    base_version: int | None
    result_version: int
    document: Any
    deleted: bool


def land_write(
    planned: Written,
    *,
    target: InTransactionTarget,
    fence: int,
    now: datetime,
    action: Action,
    operation_id: int,
    event: EventSpec,
) -> WriteResult:
    """Write `planned` (an update's document or a delete's tombstone, at its base version
    + 1) through `target`, record it, and append `event` (`write.applied`); a miss — nothing
    written, nothing appended — when the row is no longer at the base version, is a
    tombstone, or has seen `fence`. The append is sent with the write (one round trip) and
    made only if the operation is `done` when it runs — the row is locked by this
    transaction and was pending, so only this write's statement can have made it so."""
    observed = planned.base_version
    assert observed is not None  # an update or a delete: it observed a version
    appending = audit_append_if(_LANDED, [operation_id, OperationStatus.DONE.value], **event)
    carried = Carried(
        statements=_records(planned, fence, now, action, operation_id),
        then=None if appending is None else (appending.sql, appending.params),
    )
    landed = target.write_carrying(
        planned.resource_id,
        planned.document,
        expected_version=str(observed),
        deleted=planned.deleted,
        fence=fence,
        carried=carried,
    )
    if appending is None:  # not one statement here (audit_deferred): append after
        if landed.result.applied:
            audit_append(**event)
        return landed.result
    appended = appending.appended(landed.then_row)
    # The guard reads the operation this statement made `done`: both hold or neither.
    assert landed.result.applied == (appended is not None)
    return landed.result


# The guard of the append: true once this write's statement has made its operation `done`.
_LANDED = "EXISTS (SELECT 1 FROM approvals_operation WHERE id = %s AND status = %s)"


def _as_jsonb(value: Any) -> Any:
    return Operation._meta.get_field("outcome").get_db_prep_value(value, connection)


def _records(
    planned: Written, fence: int, now: datetime, action: Action, operation_id: int
) -> list[tuple[str, list[Any]]]:
    """The history row, the operation done and the action applied, with their values."""
    observed = planned.base_version
    history = [action.operation, fence, action.run_id, action.pk, now]
    done = [OperationStatus.DONE.value, fence, str(observed), str(planned.result_version)]
    done += [now + undo_window(action), now, _as_jsonb({"result": "applied"}), operation_id]
    applied = [ActionStatus.APPLIED.value, planned.resource_id, now, action.pk]
    return [(_HISTORY, history), (_OPERATION_DONE, done), (_ACTION_APPLIED, applied)]
