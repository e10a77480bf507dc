"""The write barrier: every accepted write is one conditional write through the kind's
adapter — one whose capabilities say `in_caller_transaction` (Airlock's own store: one
conditional UPDATE, or an INSERT).

`apply_action` finishes an operation opened by engine.core.operations, in ONE
transaction. Lock order (the project's one order): the kill-switch lock SHARED, the
operation row, the run row FOR SHARE, the action row; then re-check the kill switch and the
run (a revoke/finish/expiry updates the run row: one of the two waits for the other), then

    UPDATE ownership_resource SET document, version = version + 1, last_fence = :fence
     WHERE id = :id AND version = :observed AND last_fence < :fence AND NOT deleted

(Airlock's store's statement, engine/core/managed_target.py, which carries the barrier's
records: engine/core/land.py; its `create` for a create — an INSERT, or a conditional
revive of a tombstone), the new
ResourceVersion row, Operation -> done (undo deadline from the kind/class window),
Action -> applied (revision + 1), and the audit event `write.applied` — last,
because it locks the audit head row until commit.

Zero rows: the adapter reads the resource back and says where it stands (`Held`), which
tells a stale fence from a stale version from a missing resource; the refusal is recorded
(Operation -> failed with the outcome, audit `write.refused`), nothing else changes, and
the caller (the engine) gets WriteOutcome(applied=False, refusal=...) to route: a stale
version becomes a conflict, a stale fence means a newer holder has written (take a new fence).

This module never touches Redis: publishing wake-ups after commit is the caller's job.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Case, F, Field, Model, Value, When
from django.db.models.expressions import RawSQL
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Operation,
    OperationStatus,
    WriteOperation,
)
from audit.services import Actor, EventSpec, audit_append
from console.compiled_query import CompiledInsert
from console.tracing import traced
from engine.core.action_audit import action_event
from engine.core.killswitch import refuse_if_engaged
from engine.core.kind_targets import adapter_for_kind
from engine.core.land import Written, land_write, undo_window
from engine.core.operations import EXECUTABLE_STATUSES
from engine.core.row_locks import action_locked, operation_locked, run_of_action
from engine.core.versions import counter, token
from engine.core.write_rows import (
    NOT_READ,
    LockedRows,
    lock_run_for_share,
    lock_write_rows,
    run_end_status,
)
from engine.targets.base import InTransactionTarget, Outcome, WriteResult
from ownership.diff import proposed_document
from ownership.models import Resource, ResourceVersion

# Why a write was refused (WriteOutcome.refusal.reason).
STALE_VERSION = "stale_version"  # someone wrote since the agent read: route to a conflict
STALE_FENCE = "stale_fence"  # a newer lock holder has written: this holder is a zombie
MISSING = "missing"  # no such resource, or it is a tombstone
ALREADY_EXISTS = "already_exists"  # create of a name that exists (e.g. a concurrent create won)
OPERATION_NOT_PENDING = "operation_not_pending"  # re-delivery of a finished operation
ACTION_NOT_EXECUTABLE = "action_not_executable"  # the action left queued/paused/executing
RUN_NOT_ACTIVE = "run_not_active"  # the run was revoked/finished/rejected or is past expires_at


@dataclass(frozen=True)
class Refusal:
    reason: str
    message: str
    expected_version: int | None = None
    current_version: int | None = None
    fence: int | None = None
    current_fence: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WriteOutcome:
    applied: bool
    action_id: uuid.UUID
    operation_id: int
    fence: int
    resource_id: int | None = None
    base_version: int | None = None
    result_version: int | None = None
    undo_deadline: datetime | None = None
    refusal: Refusal | None = None

    @property
    def reason(self) -> str | None:
        return self.refusal.reason if self.refusal else None


@traced("airlock.barrier")
def apply_action(
    *,
    action_id: uuid.UUID | str,
    operation_id: int,
    fence: int,
    actor: Actor,
    before_commit: Callable[[], None] | None = None,
    locked: LockedRows | None = None,
    savepoint: bool = True,
) -> WriteOutcome:
    """Apply the action's write through the barrier, in one transaction.

    Raises NotFound (no such action/operation) and KillSwitchEngaged (nothing is
    written, the operation stays pending: the caller pauses the action). Every
    other outcome, accepted or refused, is recorded and returned.

    The audit event is attributed to the action's run (Actor.run); `actor` — who
    carried it out, e.g. the worker — is kept in the details as `executor`.
    `before_commit` runs last inside the transaction (the engine registers its
    wake-up there), so a caller needs no enclosing transaction and its savepoint.
    `locked`: the rows a batch already locked in its transaction (lock_batch_rows);
    such a batch may also ask for no savepoint of this write's own (`savepoint=False`:
    an error then dooms the caller's whole transaction, which the caller redoes).
    """
    with transaction.atomic(savepoint=savepoint):
        outcome = _apply_in_transaction(
            action_id=action_id, operation_id=operation_id, fence=fence, actor=actor, locked=locked
        )
        if before_commit is not None:
            before_commit()
        return outcome


def _apply_in_transaction(
    *,
    action_id: uuid.UUID | str,
    operation_id: int,
    fence: int,
    actor: Actor,
    locked: LockedRows | None,
) -> WriteOutcome:
    if locked is None:
        locked = lock_write_rows(action_id=action_id, operation_id=operation_id)
    operation, run_state, action = locked.operation, locked.run_state, locked.action
    if operation.status != OperationStatus.PENDING:
        # A re-delivered job: the first delivery already recorded the outcome.
        return _finished_outcome(action, operation)

    if not locked.switches_clear:
        refuse_if_engaged(action.resource_identifier)

    if action.status not in EXECUTABLE_STATUSES:
        refusal = Refusal(ACTION_NOT_EXECUTABLE, f"the action is {action.status}", fence=fence)
        return record_refusal(
            action, operation, refusal, actor=actor, resource_id=action.resource_id
        )

    now = timezone.now()
    ended = run_end_status(action, run_state, now=now)
    if ended is not None:
        return _refuse_ended_run(action, operation, ended, fence=fence, actor=actor, now=now)
    if action.operation == WriteOperation.CREATE:
        result = _write_create(action, fence=fence, now=now)
    else:
        landing = operation if connection.vendor == "postgresql" else None
        result = _write_existing(
            action, fence=fence, now=now, current=locked.resource, landing=landing, actor=actor
        )
        if landing is not None and isinstance(result, Written):  # recorded and audited
            return _applied(action, operation, result, fence=fence, now=now)
    if isinstance(result, _Refused):
        return record_refusal(
            action, operation, result.refusal, actor=actor, resource_id=result.resource_id
        )

    return record_applied([(action, operation, result)], fence=fence, actor=actor, now=now)[0]


def _refuse_ended_run(
    action: Action,
    operation: Operation,
    end_status: str,
    *,
    fence: int,
    actor: Actor,
    now: datetime,
) -> WriteOutcome:
    """The run no longer allows writes: nothing is written, the action ends."""
    refusal = Refusal(
        RUN_NOT_ACTIVE,
        "the run has expired" if end_status == ActionStatus.EXPIRED else "the run is not active",
        fence=fence,
    )
    Action.objects.filter(pk=action.pk, status__in=EXECUTABLE_STATUSES).update(
        status=end_status,
        revision=F("revision") + 1,
        updated_at=now,
        error={"code": RUN_NOT_ACTIVE, "detail": refusal.message},
    )
    return record_refusal(action, operation, refusal, actor=actor, resource_id=action.resource_id)


def refuse_if_run_ended(
    *, action_id: uuid.UUID | str, operation_id: int, fence: int, actor: Actor
) -> WriteOutcome | None:
    """For writes that do not go through `apply_action` (HTTP targets): the same
    run check, in its own transaction and the same lock order. Returns the
    refusal (the action ended, the operation failed) or None to go ahead."""
    with transaction.atomic():
        operation = operation_locked(operation_id)
        run_id = run_of_action(action_id)
        run_state = lock_run_for_share(run_id) if run_id is not None else None
        action = action_locked(action_id, related=True)
        if operation is None or operation.status != OperationStatus.PENDING:
            return None
        now = timezone.now()
        ended = run_end_status(action, run_state, now=now)
        if ended is None:
            return None
        return _refuse_ended_run(action, operation, ended, fence=fence, actor=actor, now=now)


@dataclass(frozen=True)
class _Refused:
    refusal: Refusal
    resource_id: int | None = None


# The history rows of every applied write (a drain's batch: one statement).
_INSERT_VERSIONS = CompiledInsert(ResourceVersion)


def record_applied(
    writes: Sequence[tuple[Action, Operation, Written]],
    *,
    fence: int,
    actor: Actor,
    now: datetime,
) -> list[WriteOutcome]:
    """The writes happened: their history rows, their operations done (undo deadline
    from the kind/class window), their actions applied — one statement each, however many
    writes (the drain records its batch at once) — and their audit events last, in order."""
    deadlines = {operation.pk: now + undo_window(action) for action, operation, _ in writes}
    _INSERT_VERSIONS.insert_many(
        ResourceVersion(
            resource_id=written.resource_id,
            version=written.result_version,
            document=written.document,
            deleted=written.deleted,
            operation=action.operation,
            fence=fence,
            run_id=action.run_id,
            action_id=action.pk,
        )
        for action, _, written in writes
    )
    operation_ids = [operation.pk for _, operation, _ in writes]
    Operation.objects.filter(pk__in=operation_ids).update(
        status=OperationStatus.DONE,
        fence=fence,
        base_version=_per_row(
            Operation, "base_version", {op.pk: token(w.base_version) for _, op, w in writes}
        ),
        result_version=_per_row(
            Operation, "result_version", {op.pk: token(w.result_version) for _, op, w in writes}
        ),
        undo_deadline=_per_row(Operation, "undo_deadline", deadlines),
        finished_at=now,
        outcome={"result": "applied"},
    )
    Action.objects.filter(pk__in=[action.pk for action, _, _ in writes]).update(
        status=ActionStatus.APPLIED,
        revision=F("revision") + 1,
        resource_id=_per_row(Action, "resource", {a.pk: w.resource_id for a, _, w in writes}),
        error=None,
        updated_at=now,
    )
    outcomes = []
    for action, operation, written in writes:
        audit_append(**_applied_event(action, operation, written, fence=fence, actor=actor))
        outcomes.append(_applied(action, operation, written, fence=fence, now=now))
    return outcomes


def _applied_event(
    action: Action, operation: Operation, written: Written, *, fence: int, actor: Actor
) -> EventSpec:
    details = {
        "fence": fence,
        "from_version": token(written.base_version),
        "to_version": token(written.result_version),
    }
    return _write_event("write.applied", action, operation, actor=actor, details=details)


def _applied(
    action: Action, operation: Operation, written: Written, *, fence: int, now: datetime
) -> WriteOutcome:
    return WriteOutcome(
        applied=True,
        action_id=action.pk,
        operation_id=operation.pk,
        fence=fence,
        resource_id=written.resource_id,
        base_version=written.base_version,
        result_version=written.result_version,
        undo_deadline=now + undo_window(action),
    )


def _per_row(model: type[Model], field_name: str, values: Mapping[Any, Any]) -> Any:
    """A column's value row by row (by primary key), for an UPDATE of several rows.

    On PostgreSQL a plain `CASE pk WHEN … THEN … END` cast to the column's type: Django's
    Case/When resolves and copies every When's expressions, about 1.5 ms of Python a row
    for the drain's batch of 32 (three columns: a third of the batch's time)."""
    if len(values) == 1:
        return next(iter(values.values()))
    field = model._meta.get_field(field_name)
    assert isinstance(field, Field)
    if connection.vendor != "postgresql":
        return Case(*(When(pk=pk, then=Value(v, output_field=field)) for pk, v in values.items()))
    pk = model._meta.pk
    assert pk is not None
    params: list[Any] = []
    for key, value in values.items():
        params.append(pk.get_db_prep_value(key, connection))
        params.append(field.get_db_prep_value(value, connection))
    whens = " ".join(["WHEN %s THEN %s"] * len(values))
    sql = f'CAST(CASE "{pk.column}" {whens} END AS {field.db_type(connection)})'
    return RawSQL(sql, params, output_field=field)  # noqa: S611 - names from the model's metadata


def _write_existing(
    action: Action,
    *,
    fence: int,
    now: datetime,
    current: Any = NOT_READ,
    landing: Operation | None = None,
    actor: Actor | None = None,
) -> Written | _Refused:
    """Update or delete: the adapter's one conditional write, then classify a miss.
    `current`: the resource's id and document (Airlock's record of it) when the caller's
    batch read them. `landing` (PostgreSQL): the write's operation — the write then also
    records itself (history row, operation done, action applied) in the same statement and
    its audit event by `actor` right after it, in the same round trip (land.py)."""
    observed = counter(action.observed_version)
    assert observed is not None  # a constraint: updates and deletes observe a version
    if current is NOT_READ:
        current = (
            Resource.objects.filter(kind_id=action.kind_id, name=action.name)
            .values("id", "document")
            .first()
        )
    if current is None:
        return _Refused(
            Refusal(MISSING, "the resource does not exist", expected_version=observed, fence=fence)
        )
    planned = planned_write(action, current)
    target = in_transaction_target(action)
    if landing is not None:
        assert actor is not None
        event = _applied_event(action, landing, planned, fence=fence, actor=actor)
        result = land_write(
            planned,
            target=target,
            fence=fence,
            now=now,
            action=action,
            operation_id=landing.pk,
            event=event,
        )
    elif planned.deleted:
        result = target.delete(
            action.name, expected_version=str(observed), fence=fence, idempotency_key=""
        )
    else:
        result = target.write(
            action.name,
            planned.document,
            expected_version=str(observed),
            fence=fence,
            idempotency_key="",
        )
    if result.applied:
        return planned
    return _Refused(refusal_of_miss(result, expected=observed, fence=fence), current["id"])


def in_transaction_target(action: Action) -> InTransactionTarget:
    """The kind's adapter; the barrier records each write in the write's own transaction,
    so it takes only an adapter that writes there (the executor sends the others to
    approvals/services/external_writes.py)."""
    target = adapter_for_kind(action.kind)
    if not (target.capabilities.in_caller_transaction and isinstance(target, InTransactionTarget)):
        raise TypeError(f"{action.kind_id}: its adapter does not write in the caller's transaction")
    return target


def planned_write(action: Action, current: Mapping[str, Any]) -> Written:
    """What an update or delete of `current` (the resource's id and document) holds if it
    lands at the observed version. The merge patch is computed from that document; if anyone
    wrote since, the version precondition fails and nothing is written. A tombstone keeps its
    last document (readers see a delete as `{}`; the history row keeps what was deleted)."""
    observed = counter(action.observed_version)
    assert observed is not None  # a constraint: updates and deletes observe a version
    deleting = action.operation == WriteOperation.DELETE
    document = current["document"] if deleting else proposed_document(action, current["document"])
    return Written(current["id"], observed, observed + 1, document, deleting)


def _write_create(action: Action, *, fence: int, now: datetime) -> Written | _Refused:
    """Create through the adapter (Airlock's store: an INSERT — the unique kind+name
    constraint refuses a concurrent twin — or the conditional revival of a tombstone)."""
    document = proposed_document(action, {})
    result = in_transaction_target(action).create(
        action.name, document, fence=fence, idempotency_key=""
    )
    if result.applied:
        assert result.record_id is not None and result.version is not None
        version = counter(result.version)
        assert version is not None
        # The store counts from 1; a revived tombstone goes on from its own counter.
        base = version - 1 if version > 1 else None
        return Written(result.record_id, base, version, document, False)
    held = result.held
    assert held is not None  # the name exists: the adapter read it back
    if result.outcome is Outcome.FENCED:
        refusal = _stale_fence(_as_row(held.version, held.fence), expected=None, fence=fence)
    elif not held.absent:
        refusal = _already_exists(_as_row(held.version, held.fence), fence)
    else:
        refusal = _refusal_from_row(
            STALE_VERSION,
            "the tombstone changed while it was being revived",
            _as_row(held.version, held.fence),
            expected=None,
            fence=fence,
        )
    return _Refused(refusal, result.record_id)


def refusal_of_miss(result: WriteResult, *, expected: int, fence: int) -> Refusal:
    """Why an update or delete missed, from where the adapter found the resource: a stale
    fence first (a holder whose fence is stale must not write at all, and its refusal is
    not a conflict for a person — a newer holder has the resource), then a tombstone, then
    a version that moved on."""
    held = result.held
    assert held is not None  # an adapter in the caller's transaction reads a miss back
    row = _as_row(held.version, held.fence)
    if result.outcome is Outcome.FENCED:
        return _stale_fence(row, expected=expected, fence=fence)
    if held.absent:
        return _refusal_from_row(
            MISSING, "the resource has been deleted", row, expected=expected, fence=fence
        )
    return _refusal_from_row(
        STALE_VERSION,
        f"the resource is at version {held.version}, the action observed {expected}",
        row,
        expected=expected,
        fence=fence,
    )


def _as_row(version: str, last_fence: int) -> Mapping[str, Any]:
    """Where the resource stands, as the refusal reports it (the store's counter)."""
    return {"version": counter(version), "last_fence": last_fence}


def _stale_fence(fresh: Mapping[str, Any], *, expected: int | None, fence: int) -> Refusal:
    return _refusal_from_row(
        STALE_FENCE,
        f"fence {fence} is stale: fence {fresh['last_fence']} has already written",
        fresh,
        expected=expected,
        fence=fence,
    )


def _refusal_from_row(
    reason: str, message: str, row: Mapping[str, Any], *, expected: int | None, fence: int
) -> Refusal:
    """A refusal that reports the resource row as re-read: its version and last fence."""
    return Refusal(
        reason,
        message,
        expected_version=expected,
        current_version=row["version"],
        fence=fence,
        current_fence=row["last_fence"],
    )


def _already_exists(existing: Mapping[str, Any], fence: int) -> Refusal:
    return _refusal_from_row(
        ALREADY_EXISTS,
        "a resource with this name already exists",
        existing,
        expected=None,
        fence=fence,
    )


def record_refusal(
    action: Action,
    operation: Operation,
    refusal: Refusal,
    *,
    actor: Actor,
    resource_id: int | None,
) -> WriteOutcome:
    """Record a refusal: the operation fails with the outcome; the resource is untouched."""
    Operation.objects.filter(pk=operation.pk).update(
        status=OperationStatus.FAILED,
        outcome=refusal.as_dict(),
        finished_at=timezone.now(),
    )
    details = refusal.as_dict()
    audit_append(**_write_event("write.refused", action, operation, actor=actor, details=details))
    return WriteOutcome(
        applied=False,
        action_id=action.pk,
        operation_id=operation.pk,
        fence=refusal.fence if refusal.fence is not None else operation.fence,
        resource_id=resource_id,
        refusal=refusal,
    )


def _write_actor(action: Action) -> Actor:
    """A write (and its refusal) is the run's: the run is the accountable principal."""
    return Actor.run(action.run)


def _write_event(
    event_type: str, action: Action, operation: Operation, *, actor: Actor, details: dict[str, Any]
) -> EventSpec:
    """The run's audit event for a write or its refusal, naming the executor."""
    return action_event(
        action,
        event_type=event_type,
        actor=_write_actor(action),
        details={
            "operation": action.operation,
            "operation_id": operation.pk,
            **details,
            **_executor(actor, action),
        },
    )


def _executor(actor: Actor, action: Action) -> dict[str, Any]:
    """Who carried the write out (e.g. the worker), when that is not the run itself."""
    if actor == _write_actor(action):
        return {}
    return {"executor": {"type": actor.type, "id": actor.id, "label": actor.label}}


def _finished_outcome(action: Action, operation: Operation) -> WriteOutcome:
    """The recorded outcome of an operation that already finished (no new writes)."""
    which: dict[str, Any] = {
        "action_id": action.pk,
        "operation_id": operation.pk,
        "fence": operation.fence,
        "resource_id": action.resource_id,
    }
    if operation.status == OperationStatus.DONE or operation.status == OperationStatus.UNDONE:
        return WriteOutcome(
            applied=True,
            base_version=counter(operation.base_version),
            result_version=counter(operation.result_version),
            undo_deadline=operation.undo_deadline,
            **which,
        )
    recorded = operation.outcome or {}
    known = {f for f in Refusal.__dataclass_fields__ if f in recorded}
    refusal = (
        Refusal(**{f: recorded[f] for f in known})
        if {"reason", "message"} <= known
        else Refusal(OPERATION_NOT_PENDING, f"the operation is {operation.status}")
    )
    return WriteOutcome(applied=False, refusal=refusal, **which)
