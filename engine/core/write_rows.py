"""The rows a write locks before it writes, in the one lock order (engine/core/barrier.py):
the kill-switch lock SHARED, the operation row, the run row FOR SHARE, the action row.

`lock_write_rows` locks them for one write (the barrier's own first step);
`lock_batch_rows` locks them for a batch of writes in one transaction (the drain), each
kind of row in one statement and in id order, before any of the batch's writes — so a
batch takes its locks in the same order as a single write, and the audit head (taken
last, by audit_deferred) after all of them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from django.db import connection
from django.db.models import F, Model, Q

from approvals.models import (
    Action,
    ActionStatus,
    Agent,
    Operation,
    Run,
    RunStatus,
    WriteOperation,
    run_end_exempt,
)
from engine.core.errors import NotFound
from engine.core.killswitch import SWITCH_LOCK_SHARED, any_engaged, hold_switches_shared
from engine.core.kind_targets import in_caller_transaction
from engine.core.raw_rows import from_row, model_columns, select_list
from ownership.models import ConflictClass, Resource, ResourceKind

# `LockedRows.resource` when the resource was not read with the rows (the barrier reads it).
NOT_READ: Any = object()


@dataclass(frozen=True)
class LockedRows:
    """One write's rows, locked in its transaction. `switches_clear`: no kill switch was
    engaged when checked under the shared switch lock (held to commit, so none can be
    engaged since): the barrier need not look again. `resource`: an update's or delete's
    resource `{"id", "document"}` (None: no such resource) read with the batch — not
    locked: the barrier's conditional UPDATE still refuses it if it moved since."""

    operation: Operation
    run_state: tuple[str, datetime] | None
    action: Action
    switches_clear: bool = False
    resource: Any = NOT_READ


def lock_write_rows(*, action_id: uuid.UUID | str, operation_id: int) -> LockedRows:
    """Lock one write's rows (caller's transaction). Raises NotFound."""
    # Before any row lock: an engage waits for this write, or this write sees it.
    if connection.vendor == "postgresql":
        return _lock_write_rows_sql(action_id, operation_id)
    hold_switches_shared()
    # The action's run id comes with the operation row (one statement; only the
    # operation row is locked here, the run and the action follow in order).
    operation = (
        Operation.objects.select_for_update(of=("self",))
        .filter(pk=operation_id, action_id=action_id, undo_of__isnull=True)
        .annotate(action_run_id=F("action__run_id"))
        .first()
    )
    if operation is None:
        raise NotFound("no such operation for this action", extra={"operation": operation_id})
    run_id = operation.action_run_id
    run_state = lock_run_for_share(run_id) if run_id is not None else None
    action = (
        Action.objects.select_for_update(of=("self",))
        .select_related("kind", "conflict_class", "run__agent")
        .get(pk=action_id)
    )
    return LockedRows(operation, run_state, action)


def _lock_write_rows_sql(action_id: uuid.UUID | str, operation_id: int) -> LockedRows:
    """lock_write_rows on PostgreSQL: the same four statements, in the same order, sent
    together (psycopg's pipeline mode: one round trip, with the BEGIN, instead of five),
    raw (the ORM's query building was most of a single write's time).

    Each lock is still its own statement, run one after the other, so the one lock order
    holds and each statement's snapshot is taken after the previous lock was granted: the
    operation statement, which also says whether any kill switch is engaged, starts after
    the shared switch lock, so an engage that committed before it is seen. The run row is
    found through the action (its run never changes); the action statement also reads what
    the barrier needs of it (kind, conflict class, run, agent) and the resource's id and
    document (not locked, as in a batch: the conditional UPDATE refuses it if it moved)."""
    action_pk = _pk(Action, action_id)
    statements = _sql()
    _, operation_rows, run_rows, action_rows = _pipelined(
        (statements.switch_lock, None),
        (statements.operation, [operation_id, action_pk]),
        (statements.run, [action_pk]),
        (statements.action, [action_pk]),
    )
    found = operation_rows[0] if operation_rows else None
    run_row = run_rows[0] if run_rows else None
    row = action_rows[0] if action_rows else None
    if found is None:
        raise NotFound("no such operation for this action", extra={"operation": operation_id})
    operation, engaged = from_row(Operation, model_columns(Operation), found), found[-1]
    run_state = (str(run_row[0]), run_row[1]) if run_row else None
    if row is None:
        raise Action.DoesNotExist("Action matching query does not exist.")
    action, resource = _action_from_row(row)
    return LockedRows(
        operation,
        run_state,
        action,
        switches_clear=not engaged,
        resource=NOT_READ if action.operation == WriteOperation.CREATE else resource,
    )


def _pipelined(*statements: tuple[str, list[Any] | None]) -> list[list[Any]]:
    """Each statement's rows. Sent together (psycopg's pipeline mode: one round trip), run
    one after the other by the server; a failure is Django's DatabaseError, as an ORM
    statement's would be (the caller's transaction then rolls back)."""
    with connection.wrap_database_errors, ExitStack() as stack:
        cursors = [stack.enter_context(connection.cursor()) for _ in statements]
        with connection.connection.pipeline():
            for cursor, (sql, params) in zip(cursors, statements, strict=True):
                cursor.execute(sql, params)
        return [cursor.fetchall() for cursor in cursors]


# What the action statement reads beside the action, in its column order: the action's
# kind, conflict class and run, and the run's agent.
_RELATED: tuple[type[Model], ...] = (ResourceKind, ConflictClass, Run, Agent)


def _action_from_row(row: Sequence[Any]) -> tuple[Action, dict[str, Any] | None]:
    """The action (its kind, conflict class, run and agent attached) and its resource's
    `{"id", "document"}` (None: no such resource) from an action statement's row."""
    action = from_row(Action, model_columns(Action), row)
    offset = len(model_columns(Action))
    related: list[Any] = []
    for model in _RELATED:
        related.append(from_row(model, model_columns(model), row, offset))
        offset += len(model_columns(model))
    action.kind, action.conflict_class, action.run, action.run.agent = related
    resource_id, document = row[offset], row[offset + 1]
    resource = None if resource_id is None else {"id": resource_id, "document": _json(document)}
    return action, resource


@dataclass(frozen=True)
class _Statements:
    switch_lock: str
    operation: str
    run: str
    action: str
    # The same over a batch: each takes the array of its operation ids.
    operations: str
    runs: str
    actions: str


@cache
def _sql() -> _Statements:
    """The statements' text, built once from the models' columns."""

    def cols(model: type[Model], alias: str) -> str:
        return select_list(model_columns(model), alias)

    # Read with the operation rows, after the shared switch lock: an engage committed
    # before it is seen.
    any_engaged_sql = "EXISTS (SELECT 1 FROM console_killswitch s WHERE s.engaged)"

    operation = (
        f"SELECT {cols(Operation, 'o')}, "  # noqa: S608
        f"{any_engaged_sql} "
        "FROM approvals_operation o "
        "WHERE o.id = %s AND o.action_id = %s AND o.undo_of_id IS NULL FOR UPDATE OF o"
    )
    run = (
        "SELECT status, expires_at FROM approvals_run "
        "WHERE id = (SELECT run_id FROM approvals_action WHERE id = %s) FOR SHARE"
    )
    action_rows = (
        f"SELECT {cols(Action, 'a')}, {cols(ResourceKind, 'k')}, {cols(ConflictClass, 'c')}, "  # noqa: S608
        f"{cols(Run, 'r')}, {cols(Agent, 'g')}, res.id, res.document "
        f"FROM approvals_action a "
        f"JOIN {ResourceKind._meta.db_table} k ON k.{_pk_column(ResourceKind)} = a.kind_id "
        f"JOIN {ConflictClass._meta.db_table} c "
        f"ON c.{_pk_column(ConflictClass)} = a.conflict_class_id "
        f"JOIN approvals_run r ON r.id = a.run_id JOIN approvals_agent g ON g.id = r.agent_id "
        "LEFT JOIN ownership_resource res ON res.kind_id = a.kind_id AND res.name = a.name "
    )
    # A batch's operations: those of its ids that are still an action's write (not an undo).
    of_batch = "SELECT action_id FROM approvals_operation WHERE id = ANY(%s) AND undo_of_id IS NULL"
    return _Statements(
        SWITCH_LOCK_SHARED,
        operation,
        run,
        f"{action_rows}WHERE a.id = %s FOR UPDATE OF a",
        operations=(
            f"SELECT {cols(Operation, 'o')}, "  # noqa: S608
            f"{any_engaged_sql} "
            "FROM approvals_operation o WHERE o.id = ANY(%s) AND o.undo_of_id IS NULL "
            "ORDER BY o.id FOR UPDATE OF o"
        ),
        runs=(
            "SELECT id, status, expires_at FROM approvals_run "  # noqa: S608
            f"WHERE id IN (SELECT run_id FROM approvals_action WHERE id IN ({of_batch})) "
            "ORDER BY id FOR SHARE"
        ),
        actions=f"{action_rows}WHERE a.id IN ({of_batch}) ORDER BY a.id FOR UPDATE OF a",
    )


def _pk(model: type[Model], value: Any) -> Any:
    pk = model._meta.pk
    assert pk is not None
    return pk.get_db_prep_value(value, connection)


def _pk_column(model: type[Model]) -> str:
    pk = model._meta.pk
    assert pk is not None
    return f'"{pk.column}"'


def _json(text: Any) -> Any:
    # Django reads jsonb as text (its JSONField decodes it); a raw row does the same.
    return None if text is None else json.loads(text) if isinstance(text, str) else text


def lock_batch_rows(
    writes: Sequence[tuple[uuid.UUID, int]],
) -> dict[uuid.UUID, LockedRows]:
    """Lock the rows of several writes `(action_id, operation_id)` (caller's transaction):
    the switch lock, then every operation, every run, every action — one statement each.
    A write whose operation is missing is left out (apply_action without `locked`
    raises NotFound for it, as for a single write)."""
    if connection.vendor == "postgresql":
        return _lock_batch_rows_sql(writes)
    # SQLite (the embedded default): the same rows through the ORM.
    hold_switches_shared()
    clear = not any_engaged()
    operations = {
        op.action_id: op
        for op in Operation.objects.select_for_update(of=("self",))
        .filter(pk__in=[op_id for _, op_id in writes], undo_of__isnull=True)
        .annotate(action_run_id=F("action__run_id"))
        .order_by("pk")
    }
    run_ids = sorted({op.action_run_id for op in operations.values() if op.action_run_id})
    runs = {run_id: state for run_id in run_ids if (state := lock_run_for_share(run_id))}
    actions = {
        action.pk: action
        for action in Action.objects.select_for_update(of=("self",))
        .select_related("kind", "conflict_class", "run__agent")
        .filter(pk__in=list(operations))
        .order_by("pk")
    }
    expected = dict(writes)
    existing = [a for a in actions.values() if a.operation != WriteOperation.CREATE]
    documents = _read_resources(existing)
    return {
        action_id: LockedRows(
            op,
            runs.get(op.action_run_id),
            action,
            clear,
            NOT_READ
            if action.operation == WriteOperation.CREATE
            else documents.get((action.kind_id, action.name)),
        )
        for action_id, op in operations.items()
        if (action := actions.get(action_id)) is not None and expected.get(action_id) == op.pk
    }


def _lock_batch_rows_sql(writes: Sequence[tuple[uuid.UUID, int]]) -> dict[uuid.UUID, LockedRows]:
    """lock_batch_rows on PostgreSQL: the single write's four statements (see
    _lock_write_rows_sql), each over the whole batch in id order, sent together in one
    round trip and read back raw — the ORM's statements and instances were ~30 ms of a
    batch of 32. The resource of each update or delete comes with its action, unlocked."""
    expected = dict(writes)
    statements = _sql()
    operation_ids = sorted(expected.values())
    _, operation_rows, run_rows, action_rows = _pipelined(
        (statements.switch_lock, None),
        (statements.operations, [operation_ids]),
        (statements.runs, [operation_ids]),
        (statements.actions, [operation_ids]),
    )
    runs = {row[0]: (str(row[1]), row[2]) for row in run_rows}
    engaged = any(row[-1] for row in operation_rows)
    operations = {
        operation.action_id: operation
        for operation in (
            from_row(Operation, model_columns(Operation), row) for row in operation_rows
        )
    }
    locked: dict[uuid.UUID, LockedRows] = {}
    for row in action_rows:
        action, resource = _action_from_row(row)
        operation = operations.get(action.pk)
        if operation is None or expected.get(action.pk) != operation.pk:
            continue
        locked[action.pk] = LockedRows(
            operation,
            runs.get(action.run_id),
            action,
            switches_clear=not engaged,
            resource=NOT_READ if action.operation == WriteOperation.CREATE else resource,
        )
    return locked


def _read_resources(actions: list[Action]) -> dict[tuple[str, str], dict[str, Any]]:
    """The id and document of the resources of several updates/deletes, in one query."""
    if not actions:
        return {}
    which = Q()
    for action in actions:
        which |= Q(kind_id=action.kind_id, name=action.name)
    rows = Resource.objects.filter(which).values("id", "kind_id", "name", "document")
    return {(r["kind_id"], r["name"]): {"id": r["id"], "document": r["document"]} for r in rows}


def lock_run_for_share(run_id: Any) -> tuple[str, datetime] | None:
    """`SELECT status, expires_at ... FOR SHARE` on the run row (caller's transaction).

    A revoke, finish, expiry or heartbeat UPDATEs the run row, so it waits for
    this transaction; one that committed first is seen (READ COMMITTED).
    """
    if connection.vendor != "postgresql":
        # SQLite (the embedded default) has no row locks; its write transactions are
        # already serialised (BEGIN IMMEDIATE).
        found = Run.objects.filter(pk=run_id).values_list("status", "expires_at").first()
        return (str(found[0]), found[1]) if found else None
    assert Run._meta.db_table == "approvals_run"
    sql = "SELECT status, expires_at FROM approvals_run WHERE id = %s FOR SHARE"
    with connection.cursor() as cursor:
        cursor.execute(sql, [Run._meta.pk.get_db_prep_value(run_id, connection)])
        row = cursor.fetchone()
    return (str(row[0]), row[1]) if row else None


def run_end_status(
    action: Action, run_state: tuple[str, datetime] | None, *, now: datetime
) -> str | None:
    """None when the action's run still allows it to write; else the action's end status
    (`cancelled` for a revoked/rejected/finished run, `expired` for an expired one).

    Exemptions (approvals.models.run_end_exempt, the same rule the run's end uses):
    a conflict-resolution action (`parent` set, created by conflict_resolve)
    carries a person's decision — and, for a quorum class, the approvals of enough
    people — not the agent's, so its run's end does not stop it: conflicts are
    often settled after the agent has gone. And a write to an external target that
    may already have reached it (an `unknown` or abandoned attempt) is settled —
    replayed with the same target Idempotency-Key, or read — never left unsettled.
    """
    if action.parent_id is not None:
        return None
    if (
        not in_caller_transaction(action.kind)
        and Action.objects.filter(pk=action.pk).filter(run_end_exempt()).exists()
    ):
        return None
    if run_state is None:
        return ActionStatus.CANCELLED
    status, expires_at = run_state
    if status == RunStatus.EXPIRED:
        return ActionStatus.EXPIRED
    if status != RunStatus.ACTIVE:
        return ActionStatus.CANCELLED
    if expires_at is not None and expires_at <= now:
        return ActionStatus.EXPIRED
    return None
