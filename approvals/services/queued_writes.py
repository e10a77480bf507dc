"""Approved writes already queued on a resource, as a proposal sees them.

A proposal whose tag matches the current version can still be doomed: an
approved write queued on the same resource, based on that same version, will
run first, and the proposal would only become a conflict at execution.
`action_propose` refuses it at once (412 naming the queued action) so the
agent waits for that write and re-reads. Proposals on one resource serialise
on `lock_resource_for_proposal`, so of two based on the same version only the
first is recorded.
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass

from django.db import connection
from django.db.models import BooleanField, Expression, QuerySet
from django.db.models.expressions import RawSQL

from approvals.models import IN_FLIGHT_STATUSES, Action
from console.advisory_locks import PROPOSALS
from console.compiled_query import CompiledQuery, Param
from ownership.models import ResourceKind

# The index's own predicate, with the statuses as literals, not parameters: the statement
# is prepared (Django's server-side binding, after five runs), and its generic plan can use
# the partial index action_in_flight only if it names that predicate. With `status IN (%s,
# %s)` that plan could not, and read the resource's actions or every action in flight.
# Code constants and a table name, so nothing to escape.
_STATUS = f'"{Action._meta.db_table}"."status"'
_IN_FLIGHT = RawSQL(  # noqa: S611
    "(" + " OR ".join(f"{_STATUS} = '{status.value}'" for status in IN_FLIGHT_STATUSES) + ")",
    (),
    BooleanField(),
)


@dataclass(frozen=True)
class QueuedWrite:
    id: uuid.UUID
    operation: str
    observed_version: str | None


def lock_resource_for_proposal(kind: str, name: str) -> None:
    """Exclusive per-resource advisory lock, after the shared kind lock and before
    any row lock (the one lock order, step 2). Only proposals take it; a hash
    collision merely serialises two resources' proposals."""
    if connection.vendor != "postgresql":
        return  # SQLite serialises writers already.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", _proposal_lock(kind, name))


def try_lock_resource_for_proposal(kind: str, name: str) -> bool:
    """lock_resource_for_proposal without waiting: False while another proposal on the
    resource holds the lock."""
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", _proposal_lock(kind, name))
        return bool(cursor.fetchone()[0])


def _proposal_lock(kind: str, name: str) -> list[int]:
    return [PROPOSALS, zlib.crc32(f"airlock.proposal:{kind}/{name}".encode()) - 2**31]


def in_flight_on(kind: str | Expression, name: str | Expression) -> QuerySet[Action]:
    """The approved writes (queued or executing) on kind/name, oldest first (a `Param`
    each for the compiled form)."""
    return Action.objects.filter(_IN_FLIGHT, kind_id=kind, name=name).order_by("created_at", "id")


# Compiled once a process: every proposal asks it under its locks (issue 41).
_WRITES_IN_FLIGHT = CompiledQuery(
    lambda: in_flight_on(
        Param("kind", ResourceKind._meta.get_field("slug")),
        Param("name", Action._meta.get_field("name")),
    ).values_list("id", "operation", "observed_version")
)


def writes_in_flight(kind: str, name: str) -> list[QueuedWrite]:
    return [QueuedWrite(*row) for row in _WRITES_IN_FLIGHT.all(kind=kind, name=name)]


def superseding_write(
    in_flight: list[QueuedWrite], *, creating: bool, observed_version: str | None
) -> QueuedWrite | None:
    """The queued write that will supersede a proposal whose tag matched: for an
    update or delete, one based on the same version; for a create, another create.
    One based on an older version is left out: it will itself be a conflict."""
    for write in in_flight:
        if (
            (write.operation == "create")
            if creating
            else (write.observed_version == observed_version)
        ):
            return write
    return None


def queued_write_over(kind: str, name: str, version: str) -> uuid.UUID | None:
    """The approved write already queued to replace `version` of kind/name, if any:
    a reader told so waits for it instead of proposing a write it would lose."""
    queued = superseding_write(
        writes_in_flight(kind, name), creating=False, observed_version=version
    )
    return None if queued is None else queued.id
