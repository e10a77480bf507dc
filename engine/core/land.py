"""A single update or delete landing in ONE statement (PostgreSQL).

The store's conditional UPDATE (the managed adapter's statement,
engine/core/managed_target.py `LAND_UPDATE`: `WHERE id AND version = :observed AND NOT
deleted AND last_fence < :fence`) and what records the write — the new ResourceVersion, the
operation `done`, the action `applied` — as one statement of data-modifying CTEs: the three
records are written only when the UPDATE returned the row, so a miss changes nothing and is
classified afterwards, as before. The operation and action rows are already locked by this
transaction (engine/core/write_rows.py), so the statement takes no lock the one lock order
does not already hold, except the resource row's, which the UPDATE takes first. The audit
event stays a statement of its own (an INSERT guarded by the operation being `done`), run
after this one but sent with it: one round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection

from approvals.models import Action, ActionStatus, OperationStatus
from audit.services import EventSpec, audit_append, audit_append_if
from engine.core.managed_target import LAND_UPDATE, as_json

# The store's own conditional UPDATE (engine/core/managed_target.py, the managed adapter's
# statement), then the write's records, each only if it returned the row.
_LAND = f"""
WITH landed AS (
    {LAND_UPDATE}
), history AS (
    INSERT INTO ownership_resourceversion (resource_id, version, document, deleted, operation,
        fence, run_id, action_id, person_id, created_at)
    SELECT id, version, document, deleted, %s, %s, %s, %s, NULL, %s FROM landed
), operation AS (
    UPDATE approvals_operation
       SET status = %s, fence = %s, base_version = %s, result_version = %s,
           undo_deadline = %s, finished_at = %s, outcome = %s
     WHERE id = %s AND EXISTS (SELECT 1 FROM landed)
), action AS (
    UPDATE approvals_action
       SET status = %s, revision = revision + 1, resource_id = %s, error = NULL,
           updated_at = %s
     WHERE id = %s AND EXISTS (SELECT 1 FROM landed)
)
SELECT count(*) FROM landed
"""  # noqa: S608 - LAND_UPDATE is the adapter's constant statement; every value is bound


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
    fence: int,
    now: datetime,
    action: Action,
    operation_id: int,
    event: EventSpec,
) -> bool:
    """Write `planned` (an update's document or a delete's tombstone, at its base version
    + 1), record it, and append `event` (`write.applied`); False — nothing written, nothing
    appended — when the row is no longer at the base version, is a tombstone, or has seen
    `fence`. The append is sent with the write (psycopg's pipeline: one round trip) and
    made only if the operation is `done` when it runs — the row is locked by this
    transaction and was pending, so only this write's statement can have made it so."""
    with connection.cursor() as cursor:
        appending = audit_append_if(_LANDED, [operation_id, OperationStatus.DONE.value], **event)
        if appending is None:  # not one statement here (audit_deferred): append after
            cursor.execute(_LAND, _land_params(planned, fence, now, action, operation_id))
            landed = _landed(cursor.fetchone())
            if landed:
                audit_append(**event)
            return landed
        with connection.wrap_database_errors, connection.cursor() as append:
            with connection.connection.pipeline():
                cursor.execute(_LAND, _land_params(planned, fence, now, action, operation_id))
                append.execute(appending.sql, appending.params)
            landed = _landed(cursor.fetchone())
            appended = appending.appended(append.fetchone())
    # The guard reads the operation this statement made `done`: both hold or neither.
    assert landed == (appended is not None)
    return landed


# The guard of the append: true once this write's statement has made its operation `done`.
_LANDED = "EXISTS (SELECT 1 FROM approvals_operation WHERE id = %s AND status = %s)"


def _landed(row: Any) -> bool:
    return bool(row and row[0] == 1)


def _land_params(
    planned: Written, fence: int, now: datetime, action: Action, operation_id: int
) -> list[Any]:
    observed = planned.base_version
    assert observed is not None  # an update or a delete: it observed a version
    return [
        as_json(planned.document),
        planned.deleted,
        fence,
        now,
        planned.resource_id,
        observed,
        fence,
        action.operation,
        fence,
        action.run_id,
        action.pk,
        now,
        OperationStatus.DONE.value,
        fence,
        str(observed),
        str(planned.result_version),
        now + undo_window(action),
        now,
        as_json({"result": "applied"}),
        operation_id,
        ActionStatus.APPLIED.value,
        planned.resource_id,
        now,
        action.pk,
    ]
