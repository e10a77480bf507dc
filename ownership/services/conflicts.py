"""Opening conflicts: when a stale write is refused, or an undo finds a later write.

A conflict keeps three documents — base (what the agent observed, as recorded at the
proposal), current (what the target holds now: read through the kind's adapter,
ownership.targets.current_state) and proposed (what the agent's write would have produced
from base) — and a field-level three-way diff by JSON pointer. The action's
conflict class decides who settles it:

- resolver `agent`: the action ends `conflict` with `retryable_by_agent: true`;
  a Conflict row is still written (so `conflict_id` is always there) and is
  closed at once with the comment "returned to the agent";
- otherwise the Conflict stays `open`, assigned to a group (`group:<name>` or
  the resource's owner group for `owner`), until a person resolves it
  (ownership.services.resolution).
"""

from __future__ import annotations

import copy
import uuid
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from approvals.models import IN_FLIGHT_STATUSES, Action, ActionStatus, Operation
from approvals.outbox import notify_action_on_commit
from approvals.services.action_status import action_transition
from audit.services import Actor
from console.permissions import resolver_group
from engine.core.action_audit import audit_action_event
from ownership.diff import proposed_document, three_way_diff
from ownership.history import NO_VERSION, base_token, document_at
from ownership.models import (
    Conflict,
    ConflictClass,
    ConflictOrigin,
    ConflictStatus,
    OnConflict,
    OwnershipRecord,
    Resource,
)
from ownership.targets import current_state

AGENT_RETURNED_COMMENT = "returned to the agent (retryable_by_agent)"


def _conflict_payload(*, action: Action, conflict: Conflict, cls: ConflictClass) -> dict[str, Any]:
    """The members of a 412 body plus `conflict_id`, as stored on the action."""
    return {
        "code": "stale_version",
        "resource": action.resource_identifier,
        "expected_etag": action.observed_etag,
        "current_etag": f'"{conflict.current_version}"',
        "conflict_class": cls.slug,
        "resolver": cls.resolver,
        "retryable": False,
        "retryable_by_agent": cls.retryable_by_agent,
        "conflict_id": str(conflict.pk),
    }


def _run_holds_lease(*, action: Action, now: datetime) -> bool:
    """Does the action's run hold an active exclusive lease covering the resource?"""
    leases = OwnershipRecord.objects.filter(
        run_id=action.run_id,
        kind_id=action.kind_id,
        active=True,
        exclusive=True,
        expires_at__gt=now,
    )
    return any(
        lease.name == action.name or (lease.is_prefix and action.name.startswith(lease.name))
        for lease in leases
    )


def _conflict_create_for_write(action: Action, resource: Resource, *, now: datetime) -> Conflict:
    """The conflict row of a stale write: base = what the agent observed, current =
    now, proposed = the write applied to base. Settled at once when the class
    returns it to the agent."""
    cls = action.conflict_class
    base = document_at(resource, action.observed_version)
    current, current_version = current_state(action.kind, resource)
    proposed = proposed_document(action, base)
    agent_resolves = cls.retryable_by_agent
    return Conflict.objects.create(
        action=action,
        resource=resource,
        conflict_class=cls,
        origin=ConflictOrigin.WRITE,
        resolver=cls.resolver,
        resolver_group=resolver_group(cls.resolver, resource.owner_group),
        status=ConflictStatus.RESOLVED if agent_resolves else ConflictStatus.OPEN,
        resolved_at=now if agent_resolves else None,
        resolution_comment=AGENT_RETURNED_COMMENT if agent_resolves else "",
        base_version=base_token(resource, action.observed_version),
        base_document=base,
        current_version=current_version,
        current_document=current,
        proposed_document=proposed,
        fields=three_way_diff(base, current, proposed),
    )


def conflict_open_for_action(
    *, action_id: uuid.UUID, operation_id: int | None = None, refusal: str = "stale_version"
) -> Conflict | None:
    """Route a stale write: record the conflict, move the action to `conflict`.

    Takes the action row lock; a no-op (None) when the action is no longer
    queued/executing (a duplicate delivery already routed it).
    """
    with transaction.atomic():
        action = (
            Action.objects.select_for_update(of=("self",))
            .select_related("conflict_class", "kind")
            .filter(pk=action_id, status__in=IN_FLIGHT_STATUSES)
            .first()
        )
        if action is None:
            return None
        resource = (
            action.resource or Resource.objects.filter(kind=action.kind, name=action.name).first()
        )
        if resource is None:
            # A stale write to something that does not exist (deleted): nothing to
            # diff against; the agent must re-read.
            action_transition(
                action_id=action.pk,
                from_statuses=IN_FLIGHT_STATUSES,
                to_status=ActionStatus.FAILED,
                error={"code": "not_found", "resource": action.resource_identifier},
            )
            return None
        cls = action.conflict_class
        now = timezone.now()
        conflict = _conflict_create_for_write(action, resource, now=now)
        payload = _conflict_payload(action=action, conflict=conflict, cls=cls)
        if cls.on_conflict == OnConflict.STOP_UNLESS_LEASE:
            # Tell the resolver whether the run held an explicit lease: with one,
            # nobody else could have written, so the later version is the run's own.
            payload["lease_covered"] = _run_holds_lease(action=action, now=now)
        action_transition(
            action_id=action.pk,
            from_statuses=IN_FLIGHT_STATUSES,
            to_status=ActionStatus.CONFLICT,
            error=payload,
            resource=resource,
        )
        if operation_id is not None:
            Operation.objects.filter(pk=operation_id, status="pending").update(
                status="failed", finished_at=now, outcome={"refused": refusal}
            )
        _audit_conflict_opened(
            action,
            conflict,
            {
                "conflict_class": cls.slug,
                "resolver": cls.resolver,
                "resolver_group": conflict.resolver_group,
                "retryable_by_agent": cls.retryable_by_agent,
                "base_version": action.observed_version or NO_VERSION,
                "current_version": conflict.current_version,
                "fields": [row["path"] for row in conflict.fields],
                "lease_covered": payload.get("lease_covered"),
            },
        )
    return conflict


def _undo_target_document(
    resource: Resource, undone_operation: Operation, undo_operation: Operation | None
) -> dict[str, Any]:
    """What the undo would write: the version before the write, or a plan's explicit
    compensation document (`restore`; a deletion restores nothing: `{}`)."""
    restore = undo_operation.restore if undo_operation is not None else None
    if isinstance(restore, dict):
        return {} if restore.get("deleted") else copy.deepcopy(restore.get("document") or {})
    return document_at(resource, undone_operation.base_version)


def conflict_open_for_undo(
    *,
    action: Action,
    resource: Resource,
    undone_operation: Operation,
    requested_by: str,
    undo_operation: Operation | None = None,
    base_version: str | None = None,
    conflict_class: ConflictClass | None = None,
) -> Conflict:
    """An undo that found a later write: a person decides (caller's transaction).

    base = the version the action produced, current = now, proposed = the
    document from before the action (what the undo would restore). A plan's
    compensation that waits for a person names its own `base_version` (before the
    step; 0: nothing, the step created the resource) and `conflict_class` (the class
    of the write the compensation is).
    """
    cls = conflict_class or action.conflict_class
    group = resolver_group(cls.resolver, resource.owner_group) or resource.owner_group
    if base_version is None:
        base_version = undone_operation.result_version or resource.token
    base_version = str(base_version)
    base = document_at(resource, base_version)
    current, current_version = current_state(action.kind, resource)
    proposed = _undo_target_document(resource, undone_operation, undo_operation)
    existing = Conflict.objects.filter(action=action, origin=ConflictOrigin.UNDO).first()
    if existing is not None:
        return existing
    conflict = Conflict.objects.create(
        action=action,
        resource=resource,
        conflict_class=cls,
        origin=ConflictOrigin.UNDO,
        resolver=cls.resolver if not cls.retryable_by_agent else "owner",
        resolver_group=group,
        status=ConflictStatus.OPEN,
        base_version=base_version,
        base_document=base,
        current_version=current_version,
        current_document=current,
        proposed_document=proposed,
        fields=three_way_diff(base, current, proposed),
    )
    _audit_conflict_opened(
        action,
        conflict,
        {
            "origin": "undo",
            "resolver_group": group,
            "requested_by": requested_by,
            "base_version": base_version,
            "current_version": current_version,
        },
    )
    notify_action_on_commit(action.pk)
    return conflict


def _audit_conflict_opened(action: Action, conflict: Conflict, details: dict[str, Any]) -> None:
    """The worker found the conflict: the event names it, then what the caller adds."""
    audit_action_event(
        action,
        event_type="conflict.opened",
        actor=Actor.system("worker"),
        details={"conflict": str(conflict.pk), **details},
    )
