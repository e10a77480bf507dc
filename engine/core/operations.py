"""Opening an operation: the record of one execution attempt, made before the write.

The barrier (engine/core/barrier.py) and the undo (engine/core/undo.py) then
finish it exactly once, under its row lock.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from console.compiled_query import CompiledInsert
from engine.core.errors import InvalidTransition, NotFound

# An action may be (re-)executed from these statuses.
EXECUTABLE_STATUSES = (ActionStatus.QUEUED, ActionStatus.PAUSED, ActionStatus.EXECUTING)


def applied_operation(action_id: uuid.UUID | str) -> Operation | None:
    """The action's latest write that applied (done, or undone since): what an undo
    restores and what a plan's step produced; None when it never wrote."""
    return (
        Operation.objects.filter(action_id=action_id, undo_of__isnull=True)
        .filter(status__in=(OperationStatus.DONE, OperationStatus.UNDONE))
        .order_by("-started_at")
        .first()
    )


def open_operation(
    *,
    action_id: uuid.UUID | str,
    fence: int,
    worker: str,
    lease_seconds: int,
    undo_of_id: int | None = None,
    from_statuses: tuple[str, ...] = EXECUTABLE_STATUSES,
) -> Operation:
    """Record an execution attempt (status pending) before the write.

    For a write: moves the action from `from_statuses` (default queued/paused/executing)
    -> executing (revision + 1) with a conditional UPDATE; raises NotFound, or
    InvalidTransition when the action is in any other status (e.g. already applied: a
    re-delivered job must stop).

    The claim is committed without waiting for the WAL flush (synchronous_commit off
    for this transaction only): it is a recovery hint, not an outcome. The write that
    follows commits synchronously, which flushes the WAL past this commit too; if the
    database crashes first, the claim is lost with nothing written and the action is
    `queued` again, as if never claimed.

    For an undo (`undo_of_id`): the action keeps its status; at most one live
    (not failed) undo operation exists per operation (a partial unique constraint),
    so a second request gets the live one back (its fence raised if still pending)
    and `apply_undo` answers "already_undone" once it is finished; an undo refused
    for good is returned as it is (asking again repeats the refusal). Only after an
    undo failed for a retryable reason (outcome `retryable`) is a new one opened.
    """
    now = timezone.now()
    lease_expires_at = now + timedelta(seconds=lease_seconds)
    if undo_of_id is None and connection.vendor == "postgresql":
        operation = _claim(action_id, fence, worker[:200], lease_expires_at, from_statuses, now)
        if operation is None:
            _refuse_claim(action_id)
        assert operation is not None
        return operation
    with transaction.atomic():
        if undo_of_id is not None:
            return _open_undo_operation(
                action_id=action_id,
                fence=fence,
                worker=worker,
                lease_expires_at=lease_expires_at,
                undo_of_id=undo_of_id,
            )
        _commit_without_flush()
        moved = Action.objects.filter(pk=action_id, status__in=from_statuses).update(
            status=ActionStatus.EXECUTING, revision=F("revision") + 1, updated_at=now
        )
        if not moved:
            _refuse_claim(action_id)
        return Operation.objects.create(
            action_id=action_id,
            fence=fence,
            worker=worker[:200],
            lease_expires_at=lease_expires_at,
            status=OperationStatus.PENDING,
        )


def _refuse_claim(action_id: uuid.UUID | str) -> None:
    """The action did not move: say why (NotFound or InvalidTransition)."""
    status = Action.objects.filter(pk=action_id).values_list("status", flat=True).first()
    if status is None:
        raise NotFound("no such action", extra={"action": str(action_id)})
    raise InvalidTransition(
        f"the action is {status}; it cannot be executed",
        extra={"action": str(action_id), "status": status},
    )


# The claim as ONE statement: the action moves to `executing` and its pending operation is
# inserted only if it moved. In autocommit it is its own transaction, and
# `set_config(..., true)` — SET LOCAL as a function — lets that transaction commit without
# waiting for the WAL flush (read at commit, before the setting is reset); inside a
# caller's transaction the flag is false and the caller's commit is left alone.
_CLAIM = """
WITH moved AS (
    UPDATE approvals_action SET status = %s, revision = revision + 1, updated_at = %s
     WHERE id = %s AND status = ANY(%s)
    RETURNING id
), flush AS (
    SELECT CASE WHEN %s THEN set_config('synchronous_commit', 'off', true) END AS done
)
INSERT INTO approvals_operation (action_id, undo_of_id, fence, status, base_version,
    result_version, undo_deadline, outcome, worker, lease_expires_at, started_at, finished_at,
    accepted_at, paused_reason, compensation, restore)
SELECT moved.id, NULL, %s, %s, NULL, NULL, NULL, NULL, %s, %s, %s, NULL, NULL, '', false, NULL
  FROM moved, flush
RETURNING id
"""


def _claim(
    action_id: uuid.UUID | str,
    fence: int,
    worker: str,
    lease_expires_at: datetime,
    from_statuses: tuple[str, ...],
    now: datetime,
) -> Operation | None:
    """open_operation's claim on PostgreSQL (see _CLAIM); None when the action did not move."""
    pk = Action._meta.pk
    assert pk is not None
    action_pk = pk.get_db_prep_value(action_id, connection)
    params = [
        ActionStatus.EXECUTING.value,
        now,
        action_pk,
        [str(status) for status in from_statuses],
        not connection.in_atomic_block,
        fence,
        OperationStatus.PENDING.value,
        worker,
        lease_expires_at,
        now,
    ]
    with connection.cursor() as cursor:
        cursor.execute(_CLAIM, params)
        row = cursor.fetchone()
    if row is None:
        return None
    operation = Operation(
        id=row[0],
        action_id=action_pk,
        fence=fence,
        status=OperationStatus.PENDING,
        worker=worker,
        lease_expires_at=lease_expires_at,
        started_at=now,
    )
    operation._state.adding = False
    operation._state.db = connection.alias
    return operation


# A claimed batch's operations (every write the worker applies: one statement a batch).
_INSERT_OPERATIONS = CompiledInsert(Operation)


def open_operations(
    *, action_ids: Sequence[uuid.UUID], fence: int, worker: str, lease_seconds: int
) -> dict[uuid.UUID, Operation]:
    """`open_operation` for a batch under one fence (the drain): in ONE short transaction,
    every action still `queued` moves to `executing` (one conditional UPDATE … RETURNING)
    and gets its pending operation (one multi-row INSERT). Actions in any other status
    are left out of the answer: whoever moved them owns them. Committed without waiting
    for the WAL flush, like a single claim (see open_operation)."""
    if not action_ids:
        return {}
    now = timezone.now()
    lease_expires_at = now + timedelta(seconds=lease_seconds)
    pk = Action._meta.pk
    assert pk is not None
    table = Action._meta.db_table
    marks = ", ".join(["%s"] * len(action_ids))
    with transaction.atomic():
        _commit_without_flush()
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET status = %s, revision = revision + 1, updated_at = %s "  # noqa: S608
                f"WHERE status = %s AND id IN ({marks}) RETURNING id",
                [
                    ActionStatus.EXECUTING,
                    now,
                    ActionStatus.QUEUED,
                    *(pk.get_db_prep_value(i, connection) for i in action_ids),
                ],
            )
            moved = {uuid.UUID(str(row[0])) for row in cursor.fetchall()}
        operations = _INSERT_OPERATIONS.insert_many(
            Operation(
                action_id=action_id,
                fence=fence,
                worker=worker[:200],
                lease_expires_at=lease_expires_at,
                status=OperationStatus.PENDING,
            )
            for action_id in action_ids
            if action_id in moved
        )
    return {operation.action_id: operation for operation in operations}


def _commit_without_flush() -> None:
    # Only for a transaction of its own: inside a caller's it would also let the
    # caller's writes commit without the flush.
    if connection.in_atomic_block and len(connection.savepoint_ids) > 0:
        return
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")


def _open_undo_operation(
    *,
    action_id: uuid.UUID | str,
    fence: int,
    worker: str,
    lease_expires_at: datetime,
    undo_of_id: int,
) -> Operation:
    if not Operation.objects.filter(pk=undo_of_id, action_id=action_id).exists():
        raise NotFound("no such operation for this action", extra={"operation": undo_of_id})
    live = Operation.objects.filter(undo_of_id=undo_of_id).exclude(status=OperationStatus.FAILED)
    existing = live.first()
    if existing is None:
        # An undo refused for good (resource moved, window closed) stays the answer;
        # only one that failed for a retryable reason makes way for a new one.
        latest = Operation.objects.filter(undo_of_id=undo_of_id).order_by("-started_at").first()
        outcome = latest.outcome if latest is not None else None
        if latest is not None and not (isinstance(outcome, dict) and outcome.get("retryable")):
            return latest
    if existing is None:
        try:
            with transaction.atomic():
                return Operation.objects.create(
                    action_id=action_id,
                    undo_of_id=undo_of_id,
                    fence=fence,
                    worker=worker[:200],
                    lease_expires_at=lease_expires_at,
                    status=OperationStatus.PENDING,
                )
        except IntegrityError:
            # A concurrent undo request created it first; share it.
            existing = live.get()
    Operation.objects.filter(
        pk=existing.pk, status=OperationStatus.PENDING, fence__lt=fence
    ).update(fence=fence, worker=worker[:200], lease_expires_at=lease_expires_at)
    existing.refresh_from_db()
    return existing
