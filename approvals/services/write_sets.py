"""Write sets: parsing, overlap and lease checks, the per-kind advisory locks.

Two active runs never hold overlapping write authority, nor overlapping
leases. A write-set entry with `"lease": true` becomes an exclusive ownership
record (a lease, with a fence from PostgreSQL's fence sequence) when the run
becomes active: other runs' writes to it answer 423 `leased` until the run
ends (finish, revoke, expiry) and its records are released. Every path that makes
ownership records active (creation with auto-approval, activation after a
person's approval) first takes a transaction-scoped PostgreSQL advisory lock
per resource kind in its write set (`lock_kinds`, in sorted order, so two
creators cannot deadlock), then checks for overlaps, then writes. Two concurrent
creations with overlapping write sets therefore serialise on the lock and the
second sees the first's records.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import Q
from django.utils import timezone

from approvals.models import Action, ActionStatus, Agent, AutoApproveRule, Run, RunStatus
from approvals.services.run_policy import classes_for_write_set, run_quorum
from console.advisory_locks import KIND_LOCKS
from engine.core.errors import DomainError, ValidationFailed
from engine.core.fence import next_fence
from ownership.models import OwnershipRecord, ResourceKind

OPERATIONS = ("create", "update", "delete")
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=,-]*$")
_KIND_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
# Actions not yet executing die with their run.
OPEN_ACTION_STATUSES = (ActionStatus.PENDING_APPROVAL, ActionStatus.QUEUED, ActionStatus.PAUSED)


class WriteSetConflict(DomainError):
    code = "write_set_conflict"


@dataclass(frozen=True)
class WriteSetEntry:
    kind: str
    name: str  # exact name, or the prefix when is_prefix
    is_prefix: bool
    operations: tuple[str, ...]
    lease: bool = False  # an exclusive lease while the run is active

    @property
    def pattern(self) -> str:
        return f"{self.kind}/{self.name}{'*' if self.is_prefix else ''}"

    def as_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"resource": self.pattern, "operations": list(self.operations)}
        if self.lease:
            entry["lease"] = True
        return entry


def _parse_resource_pattern(raw: str) -> tuple[str, str, bool]:
    """`kind/name` or `kind/prefix*` -> (kind, name-or-prefix, is_prefix). Raises ValueError."""
    if not isinstance(raw, str) or "/" not in raw:
        raise ValueError("must look like kind/name or kind/prefix*")
    kind, _, name = raw.partition("/")
    if not _KIND_PATTERN.match(kind) or len(kind) > 64:
        raise ValueError("the kind must be a lowercase slug")
    is_prefix = name.endswith("*")
    if is_prefix:
        name = name[:-1]
    if "*" in name:
        raise ValueError("'*' is only allowed at the end (a name prefix)")
    if len(name) > 255 or (name and not _NAME_PATTERN.match(name)):
        raise ValueError("the name has characters outside [A-Za-z0-9._:@+=,-] or is too long")
    if not name and not is_prefix:
        raise ValueError("the name is empty")
    return kind, name, is_prefix


def write_set_parse(raw: Any) -> list[WriteSetEntry]:
    """Validate a declared write set. Raises ValidationFailed (422) with per-field errors."""
    errors: list[dict[str, str]] = []
    entries: list[WriteSetEntry] = []
    if not isinstance(raw, list) or not raw:
        raise ValidationFailed(
            "The write set must be a non-empty list.",
            extra={"errors": [{"field": "write_set", "message": "must be a non-empty list"}]},
        )
    if len(raw) > 100:
        raise ValidationFailed(
            "The write set has more than 100 entries.",
            extra={"errors": [{"field": "write_set", "message": "at most 100 entries"}]},
        )
    kinds = set(ResourceKind.objects.values_list("slug", flat=True))
    for index, item in enumerate(raw):
        field = f"write_set[{index}]"
        if not isinstance(item, dict):
            errors.append({"field": field, "message": "must be an object"})
            continue
        try:
            kind, name, is_prefix = _parse_resource_pattern(item.get("resource"))  # type: ignore[arg-type]
        except ValueError as exc:
            errors.append({"field": f"{field}.resource", "message": str(exc)})
            continue
        if kind not in kinds:
            errors.append(
                {"field": f"{field}.resource", "message": f"unknown resource kind {kind!r}"}
            )
            continue
        operations = item.get("operations")
        if (
            not isinstance(operations, list)
            or not operations
            or any(op not in OPERATIONS for op in operations)
        ):
            errors.append(
                {
                    "field": f"{field}.operations",
                    "message": "must be a non-empty list of create, update, delete",
                }
            )
            continue
        lease = item.get("lease", False)
        if not isinstance(lease, bool):
            errors.append({"field": f"{field}.lease", "message": "must be true or false"})
            continue
        ordered = tuple(op for op in OPERATIONS if op in operations)
        entries.append(
            WriteSetEntry(
                kind=kind, name=name, is_prefix=is_prefix, operations=ordered, lease=lease
            )
        )
    if errors:
        raise ValidationFailed("The write set is invalid.", extra={"errors": errors})
    return entries


def names_overlap(a_name: str, a_prefix: bool, b_name: str, b_prefix: bool) -> bool:
    """Exact vs exact: equal. Exact vs prefix: the name starts with the prefix.
    Prefix vs prefix: one prefix starts with the other."""
    if not a_prefix and not b_prefix:
        return a_name == b_name
    if a_prefix and b_prefix:
        return a_name.startswith(b_name) or b_name.startswith(a_name)
    if a_prefix:
        return b_name.startswith(a_name)
    return a_name.startswith(b_name)


def lock_kinds(kinds: set[str], *, shared: bool = False) -> None:
    """Transaction-scoped advisory locks per resource kind, in sorted order.

    Exclusive: whoever makes ownership records (and leases) active. Shared:
    action_propose, so a proposal and a lease grant over the same kind
    serialise (the grant sees the proposed action, or the proposal sees the
    lease) while proposals do not wait for each other.
    """
    if connection.vendor != "postgresql":
        return  # SQLite serialises writers (BEGIN IMMEDIATE) already.
    function = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
    with connection.cursor() as cursor:
        for kind in sorted(kinds):
            key = zlib.crc32(f"airlock.ownership:{kind}".encode())
            cursor.execute(f"SELECT {function}(%s, %s)", [KIND_LOCKS, key - 2**31])


def lock_kind_for_proposal(kind: str) -> None:
    """The shared side of the per-kind lock (see lock_kinds)."""
    lock_kinds({kind}, shared=True)


# Actions that may still write: a lease is not granted over another run's.
_IN_FLIGHT_ACTION_STATUSES = (*OPEN_ACTION_STATUSES, ActionStatus.EXECUTING)


def _lease_blockers(entries: list[WriteSetEntry], *, exclude_run_id: Any) -> list[dict[str, Any]]:
    """Other runs' actions still in flight on names a lease entry covers (kind locks held).

    A lease promises that no other run's write lands while it is held, so one
    is granted only when no such write is pending approval, queued, paused or
    executing.
    """
    blockers: list[dict[str, Any]] = []
    leases = [entry for entry in entries if entry.lease]
    if not leases:
        return blockers
    in_flight = (
        Action.objects.filter(
            kind_id__in={entry.kind for entry in leases}, status__in=_IN_FLIGHT_ACTION_STATUSES
        )
        .exclude(run_id=exclude_run_id)
        .select_related("agent")
        .order_by("created_at", "id")
    )
    for action in in_flight:
        for entry in leases:
            if entry.kind == action.kind_id and names_overlap(
                entry.name, entry.is_prefix, action.name, False
            ):
                blockers.append(
                    {
                        "resource": f"{action.kind_id}/{action.name}",
                        "requested": entry.pattern,
                        "run": str(action.run_id),
                        "agent": action.agent.name,
                        "operations": [action.operation],
                        "lease": True,
                        "action": str(action.pk),
                    }
                )
                break
    return blockers


def _active_authority_q(now: datetime) -> Q:
    # Records of runs that still hold authority: active record, active and
    # unexpired run. Runs past expiry that housekeeping has not marked yet
    # hold nothing.
    return Q(
        active=True,
        expires_at__gt=now,
        run__status=RunStatus.ACTIVE,
        run__expires_at__gt=now,
    )


def _write_set_overlaps(
    entries: list[WriteSetEntry], *, exclude_run_id: Any = None, now: datetime | None = None
) -> list[dict[str, Any]]:
    """Every (entry, other run's record) pair whose names overlap and operations intersect."""
    now = now or timezone.now()
    kinds = {entry.kind for entry in entries}
    records = (
        OwnershipRecord.objects.filter(_active_authority_q(now), kind_id__in=kinds)
        .select_related("run__agent")
        .order_by("kind_id", "name", "run_id")
    )
    if exclude_run_id is not None:
        records = records.exclude(run_id=exclude_run_id)
    overlaps: list[dict[str, Any]] = []
    for record in records:
        for entry in entries:
            if entry.kind != record.kind_id:
                continue
            if not names_overlap(entry.name, entry.is_prefix, record.name, record.is_prefix):
                continue
            shared = [op for op in entry.operations if op in (record.operations or [])]
            # Two leases over the same names are exclusive whatever their operations.
            both_leases = entry.lease and record.exclusive
            if not shared and not both_leases:
                continue
            overlap: dict[str, Any] = {
                "resource": record.pattern,
                "requested": entry.pattern,
                "run": str(record.run_id),
                "agent": record.run.agent.name,
                "operations": shared or list(entry.operations),
            }
            if both_leases:
                overlap["lease"] = True
            overlaps.append(overlap)
    return overlaps


def auto_approved(agent: Agent, entries: list[WriteSetEntry]) -> bool:
    """Every entry covered by an enabled rule, and no per-run class asking for more
    than one person: a rule stands in for one approver, never for a quorum."""
    if run_quorum(classes_for_write_set(entry.as_json() for entry in entries)) > 1:
        return False
    rules = list(
        AutoApproveRule.objects.filter(enabled=True, kind_id__in={e.kind for e in entries}).filter(
            Q(agent__isnull=True) | Q(agent=agent)
        )
    )
    for entry in entries:
        covered = any(
            rule.kind_id == entry.kind
            and entry.name.startswith(rule.name_prefix)
            # An exact rule prefix "" covers everything; a prefix entry is
            # covered only by a rule prefix it starts with (checked above).
            and set(entry.operations) <= set(rule.operations or [])
            for rule in rules
        )
        if not covered:
            return False
    return True


def entries_of(run: Run) -> list[WriteSetEntry]:
    entries = []
    for item in run.write_set:
        kind, name, is_prefix = _parse_resource_pattern(item["resource"])
        entries.append(
            WriteSetEntry(
                kind=kind,
                name=name,
                is_prefix=is_prefix,
                operations=tuple(item["operations"]),
                lease=bool(item.get("lease", False)),
            )
        )
    return entries


def raise_on_overlap(
    entries: list[WriteSetEntry], *, exclude_run_id: Any = None, now: datetime
) -> None:
    """WriteSetConflict naming every overlap with another run's authority (kind locks held)."""
    overlaps = _write_set_overlaps(entries, exclude_run_id=exclude_run_id, now=now)
    _refuse(
        "Another active run already holds write authority",
        overlaps,
        [f"{o['resource']} ({'/'.join(o['operations'])}) held by run {o['run']}" for o in overlaps],
    )


def raise_on_lease_blockers(entries: list[WriteSetEntry], *, exclude_run_id: Any) -> None:
    """WriteSetConflict when another run's write is in flight on a lease entry (kind locks held)."""
    blockers = _lease_blockers(entries, exclude_run_id=exclude_run_id)
    _refuse(
        "A lease cannot be granted while another run's write to it is in flight",
        blockers,
        [
            f"{b['resource']} ({b['operations'][0]}, action {b['action']} of run {b['run']})"
            for b in blockers
        ],
    )


def _refuse(why: str, overlaps: list[dict[str, Any]], described: list[str]) -> None:
    if overlaps:
        raise WriteSetConflict(f"{why}: {', '.join(described)}.", extra={"overlaps": overlaps})


def ownership_records_create(run: Run, entries: list[WriteSetEntry]) -> None:
    """The run's ownership records (caller's transaction, kind locks held); a
    lease entry's record is exclusive and carries a fresh fence."""
    OwnershipRecord.objects.bulk_create(
        [
            OwnershipRecord(
                run=run,
                kind_id=entry.kind,
                name=entry.name,
                is_prefix=entry.is_prefix,
                operations=list(entry.operations),
                expires_at=run.expires_at,
                exclusive=entry.lease,
                fence=next_fence() if entry.lease else None,
            )
            for entry in entries
        ]
    )
