"""Runs: creation with a write set, activation, heartbeat, finish, expiry, revocation.

Two active runs never hold overlapping write authority, nor overlapping
leases. A write-set entry with `"lease": true` becomes an exclusive ownership
record (a lease, with a fence from PostgreSQL's fence sequence) when the run
becomes active: other runs' writes to it answer 423 `leased` until the run
ends (finish, revoke, expiry) and its records are released. Every path that makes
ownership records active (creation with auto-approval, activation after a
person's approval) first takes a transaction-scoped PostgreSQL advisory lock
per resource kind in its write set (in sorted order, so two creators cannot
deadlock), then checks for overlaps, then writes. Two concurrent creations
with overlapping write sets therefore serialise on the lock and the second
sees the first's records.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Agent,
    Approval,
    ApprovalStatus,
    AutoApproveRule,
    Run,
    RunStatus,
    run_end_exempt,
)
from approvals.notify import notify_action_changed, notify_run_changed
from approvals.services import decisions
from approvals.services.run_policy import classes_for_write_set, run_quorum
from approvals.services.tokens import RUN_PREFIX, token_generate
from audit.services import Actor, audit_append
from console.core.errors import DomainError, InvalidTransition, ValidationFailed
from ownership.models import OwnershipRecord, ResourceKind

OPERATIONS = ("create", "update", "delete")
MIN_TTL_SECONDS = 60
DEFAULT_TTL_SECONDS = 3600
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=,-]*$")
_KIND_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
# Actions not yet executing die with their run.
_OPEN_ACTION_STATUSES = (ActionStatus.PENDING_APPROVAL, ActionStatus.QUEUED, ActionStatus.PAUSED)


class RunNotActive(DomainError):
    code = "run_not_active"


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


def parse_resource_pattern(raw: str) -> tuple[str, str, bool]:
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
            kind, name, is_prefix = parse_resource_pattern(item.get("resource"))  # type: ignore[arg-type]
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


def _lock_kinds(kinds: set[str], *, shared: bool = False) -> None:
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
            cursor.execute(f"SELECT {function}(%s, %s)", [7171, key - 2**31])


def lock_kind_for_proposal(kind: str) -> None:
    """The shared side of the per-kind lock (see _lock_kinds)."""
    _lock_kinds({kind}, shared=True)


# Actions that may still write: a lease is not granted over another run's.
_IN_FLIGHT_ACTION_STATUSES = (*_OPEN_ACTION_STATUSES, ActionStatus.EXECUTING)


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


def write_set_overlaps(
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


def _auto_approved(agent: Agent, entries: list[WriteSetEntry]) -> bool:
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


def _entries_of(run: Run) -> list[WriteSetEntry]:
    entries = []
    for item in run.write_set:
        kind, name, is_prefix = parse_resource_pattern(item["resource"])
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


def _raise_on_overlap(overlaps: list[dict[str, Any]]) -> None:
    if overlaps:
        described = ", ".join(
            f"{o['resource']} ({'/'.join(o['operations'])}) held by run {o['run']}"
            for o in overlaps
        )
        raise WriteSetConflict(
            f"Another active run already holds write authority: {described}.",
            extra={"overlaps": overlaps},
        )


def _raise_on_lease_blockers(blockers: list[dict[str, Any]]) -> None:
    if blockers:
        described = ", ".join(
            f"{b['resource']} ({b['operations'][0]}, action {b['action']} of run {b['run']})"
            for b in blockers
        )
        raise WriteSetConflict(
            f"A lease cannot be granted while another run's write to it is in flight: {described}.",
            extra={"overlaps": blockers},
        )


def _create_records(run: Run, entries: list[WriteSetEntry]) -> None:
    """The run's ownership records (caller's transaction, kind locks held); a
    lease entry's record is exclusive and carries a fresh fence."""
    from console.core.fence import next_fence

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


def _max_ttl() -> int:
    return int(settings.AIRLOCK_RUN_MAX_TTL_SECONDS)


def run_create(
    *, agent: Agent, task: str, write_set: Any, ttl_seconds: int | None, actor: Actor
) -> tuple[Run, str]:
    """Create a run; returns it and its token (shown once).

    Takes the per-kind advisory locks, refuses overlaps with other active runs
    (WriteSetConflict, naming every overlap), then either activates the run at
    once (every entry covered by an enabled AutoApproveRule: ownership records,
    audit `run.auto_approved`) or leaves it pending with a run approval.
    Raises ValidationFailed for a bad write set or TTL.
    """
    entries = write_set_parse(write_set)
    ttl = DEFAULT_TTL_SECONDS if ttl_seconds is None else int(ttl_seconds)
    if ttl < MIN_TTL_SECONDS or ttl > _max_ttl():
        raise ValidationFailed(
            f"ttl_seconds must be between {MIN_TTL_SECONDS} and {_max_ttl()}.",
            extra={
                "errors": [
                    {
                        "field": "ttl_seconds",
                        "message": f"must be between {MIN_TTL_SECONDS} and {_max_ttl()}",
                    }
                ]
            },
        )
    new_token = token_generate(RUN_PREFIX)
    with transaction.atomic():
        _lock_kinds({entry.kind for entry in entries})
        now = timezone.now()
        _raise_on_overlap(write_set_overlaps(entries, now=now))
        auto = _auto_approved(agent, entries)
        if auto:
            _raise_on_lease_blockers(_lease_blockers(entries, exclude_run_id=None))
        run = Run.objects.create(
            agent=agent,
            task=task,
            write_set=[entry.as_json() for entry in entries],
            status=RunStatus.ACTIVE if auto else RunStatus.PENDING_APPROVAL,
            token_prefix=new_token.prefix,
            token_hash=new_token.hash,
            ttl_seconds=ttl,
            expires_at=now + timedelta(seconds=ttl),
            max_expires_at=now + timedelta(seconds=_max_ttl()),
            auto_approved=auto,
            activated_at=now if auto else None,
        )
        audit_append(
            event_type="run.created",
            actor=actor,
            run_id=run.id,
            details={"task": task[:500], "write_set": run.write_set, "ttl_seconds": ttl},
        )
        if auto:
            _create_records(run, entries)
            audit_append(
                event_type="run.auto_approved",
                actor=Actor.system("auto-approve"),
                run_id=run.id,
                details={"write_set": run.write_set},
            )
        else:
            _open_run_approval(run)
    return run, new_token.secret


def _open_run_approval(run: Run) -> Approval:
    return decisions.approval_open_for_run(run=run)


def run_activate(*, run: Run, actor: Actor) -> Run:
    """Make a pending run active (called when its approval reaches quorum).

    Re-checks overlaps under the per-kind locks (another run may have become
    active since this one was requested): raises WriteSetConflict and leaves
    the run pending. Raises InvalidTransition unless the run is pending.
    """
    entries = _entries_of(run)
    with transaction.atomic():
        _lock_kinds({entry.kind for entry in entries})
        now = timezone.now()
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status != RunStatus.PENDING_APPROVAL:
            raise InvalidTransition(f"Run {run.pk} is {locked.status}, not pending approval.")
        _raise_on_overlap(write_set_overlaps(entries, exclude_run_id=run.pk, now=now))
        _raise_on_lease_blockers(_lease_blockers(entries, exclude_run_id=run.pk))
        max_expires = now + timedelta(seconds=_max_ttl())
        expires = min(now + timedelta(seconds=locked.ttl_seconds), max_expires)
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.ACTIVE,
            activated_at=now,
            expires_at=expires,
            max_expires_at=max_expires,
        )
        locked.refresh_from_db()
        transaction.on_commit(partial(notify_run_changed, run.pk))
        _create_records(locked, entries)
        audit_append(
            event_type="run.activated",
            actor=actor,
            run_id=run.pk,
            details={"write_set": locked.write_set},
        )
    run.refresh_from_db()
    return run


def run_heartbeat(*, run: Run, actor: Actor) -> Run:
    """Extend an active run's expiry by its TTL, never past `max_expires_at`."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        now = timezone.now()
        if locked.status != RunStatus.ACTIVE or locked.expires_at <= now:
            raise RunNotActive(f"Run {run.pk} is {_effective_status(locked, now)}.")
        expires = min(now + timedelta(seconds=locked.ttl_seconds), locked.max_expires_at)
        if expires > locked.expires_at:
            Run.objects.filter(pk=run.pk).update(expires_at=expires, last_heartbeat_at=now)
            OwnershipRecord.objects.filter(run_id=run.pk, active=True).update(expires_at=expires)
        else:
            Run.objects.filter(pk=run.pk).update(last_heartbeat_at=now)
        transaction.on_commit(partial(notify_run_changed, run.pk))  # its expiry moved
    run.refresh_from_db()
    return run


def _effective_status(run: Run, now: datetime) -> str:
    if run.status == RunStatus.ACTIVE and run.expires_at <= now:
        return RunStatus.EXPIRED
    return str(run.status)


def run_effective_status(run: Run) -> str:
    return _effective_status(run, timezone.now())


def _end(
    run_id: Any,
    *,
    status: str,
    from_statuses: tuple[str, ...],
    actor: Actor,
    event: str,
    reason: str,
    action_status: str,
) -> bool:
    now = timezone.now()
    changed = Run.objects.filter(pk=run_id, status__in=from_statuses).update(
        status=status, ended_at=now, status_reason=reason[:1000]
    )
    if not changed:
        return False
    transaction.on_commit(partial(notify_run_changed, run_id))
    OwnershipRecord.objects.filter(run_id=run_id, active=True).update(active=False, released_at=now)
    # The project's lock order: run -> actions -> approvals -> audit head last
    # (approval_decide and action_cancel take the action before its approval).
    # A person's conflict resolution, and an external write that may already have
    # reached its target, outlive the run (run_end_exempt): they settle later.
    open_ids = list(
        Action.objects.filter(run_id=run_id, status__in=_OPEN_ACTION_STATUSES)
        .exclude(run_end_exempt())
        .values_list("id", flat=True)
    )
    if open_ids:
        Action.objects.filter(id__in=open_ids, status__in=_OPEN_ACTION_STATUSES).update(
            status=action_status,
            revision=F("revision") + 1,
            updated_at=now,
            error={"code": "run_not_active", "detail": f"the run was {status}"},
        )
        for action_id in open_ids:
            transaction.on_commit(partial(notify_action_changed, action_id))
    Approval.objects.filter(
        run_id=run_id, status=ApprovalStatus.PENDING, from_conflict__isnull=True
    ).update(status=ApprovalStatus.CANCELLED, decided_at=now)
    audit_append(
        event_type=event,
        actor=actor,
        run_id=run_id,
        details={"reason": reason[:500], "closed_actions": [str(a) for a in open_ids]},
    )
    return True


def run_finish(*, run: Run, actor: Actor) -> Run:
    """End a run and free its ownership records. Actions that have not started
    executing are cancelled. Finishing a finished run is a no-op (no second
    audit row); finishing a rejected/expired/revoked run is 409 run_not_active."""
    with transaction.atomic():
        ended = _end(
            run.pk,
            status=RunStatus.FINISHED,
            from_statuses=(RunStatus.ACTIVE, RunStatus.PENDING_APPROVAL),
            actor=actor,
            event="run.finished",
            reason="finished by the agent",
            action_status=ActionStatus.CANCELLED,
        )
    run.refresh_from_db()
    if not ended and run.status != RunStatus.FINISHED:
        raise RunNotActive(f"Run {run.pk} is {run.status}.")
    return run


def run_revoke(*, run: Run, actor: Actor, reason: str) -> Run:
    """Revoke a run (a person's decision): ownership freed, open actions cancelled."""
    with transaction.atomic():
        ended = _end(
            run.pk,
            status=RunStatus.REVOKED,
            from_statuses=(RunStatus.ACTIVE, RunStatus.PENDING_APPROVAL),
            actor=actor,
            event="run.revoked",
            reason=reason,
            action_status=ActionStatus.CANCELLED,
        )
    run.refresh_from_db()
    if not ended and run.status != RunStatus.REVOKED:
        raise InvalidTransition(f"Run {run.pk} is {run.status}.")
    return run


def run_reject(*, run: Run, actor: Actor, reason: str) -> Run:
    """A pending run's approval was rejected."""
    with transaction.atomic():
        _end(
            run.pk,
            status=RunStatus.REJECTED,
            from_statuses=(RunStatus.PENDING_APPROVAL,),
            actor=actor,
            event="run.rejected",
            reason=reason,
            action_status=ActionStatus.CANCELLED,
        )
    run.refresh_from_db()
    return run


def run_expire_due(*, now: datetime | None = None) -> int:
    """Expire active runs past `expires_at` (housekeeping calls this).

    Ownership is freed and actions not yet executing become `expired`:
    expired runs write nothing.
    """
    now = now or timezone.now()
    count = 0
    # Pending runs are ended by their approval's expiry (the engine), not here.
    due = Run.objects.filter(status=RunStatus.ACTIVE, expires_at__lte=now).values_list(
        "id", flat=True
    )
    for run_id in list(due[:1000]):
        with transaction.atomic():
            if _end(
                run_id,
                status=RunStatus.EXPIRED,
                from_statuses=(RunStatus.ACTIVE,),
                actor=Actor.system("housekeeping"),
                event="run.expired",
                reason="expired",
                action_status=ActionStatus.EXPIRED,
            ):
                count += 1
    return count
