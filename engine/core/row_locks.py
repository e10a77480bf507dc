"""The rows a write locks at each step of its record (the operation, then its action, then
the resource's mirror: the barrier's and the reconciler's order), as statements compiled
once a process (console/compiled_query.py). Every external-target write locks them two or
three times a delivery (the run check before sending, the record after); the ORM built each
queryset again at every call — a third of such a write's own work in the worker."""

from __future__ import annotations

from typing import Any

from approvals.models import Action, Operation
from console.compiled_query import CompiledQuery, Param
from ownership.models import Resource, ResourceKind

_OPERATION_ID = Operation._meta.get_field("id")
_ACTION_ID = Action._meta.get_field("id")

_OPERATION = CompiledQuery(
    lambda: Operation.objects.select_for_update().filter(pk=Param("id", _OPERATION_ID))
)
_ACTION = CompiledQuery(
    lambda: Action.objects.select_for_update(of=("self",)).filter(pk=Param("id", _ACTION_ID))
)
_ACTION_WITH_RELATED = CompiledQuery(
    lambda: (
        Action.objects.select_for_update(of=("self",))
        .select_related("kind", "conflict_class", "run__agent")
        .filter(pk=Param("id", _ACTION_ID))
    )
)
_RUN_OF_ACTION = CompiledQuery(
    lambda: Action.objects.filter(pk=Param("id", _ACTION_ID)).values_list("run_id")
)
_MIRROR = CompiledQuery(
    lambda: Resource.objects.select_for_update().filter(
        kind_id=Param("kind", ResourceKind._meta.get_field("slug")),
        name=Param("name", Resource._meta.get_field("name")),
    )
)


def operation_locked(operation_id: int) -> Operation | None:
    """The operation, locked FOR UPDATE (None: gone)."""
    found: Operation | None = _OPERATION.first(id=operation_id)
    return found


def action_locked(action_id: Any, *, related: bool = False) -> Action:
    """The action, its row locked FOR UPDATE (its related rows read, not locked, with
    `related`: kind, conflict class, run and agent). Action.DoesNotExist if gone."""
    query = _ACTION_WITH_RELATED if related else _ACTION
    action: Action = query.get(id=action_id)
    return action


def run_of_action(action_id: Any) -> Any | None:
    """The action's run id (None: no such action)."""
    row = _RUN_OF_ACTION.first(id=action_id)
    return row[0] if row is not None else None


def mirror_locked(kind_id: str, name: str) -> Resource | None:
    """The resource's mirror row, locked FOR UPDATE (None: never seen)."""
    found: Resource | None = _MIRROR.first(kind=kind_id, name=name)
    return found
