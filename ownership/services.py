"""Conflicts: opening them when a stale write is refused, and resolving them.

A conflict keeps three documents — base (what the agent observed), current
(what is there now) and proposed (what the agent's write would have produced
from base) — and a field-level three-way diff by JSON pointer. The action's
conflict class decides who settles it:

- resolver `agent`: the action ends `conflict` with `retryable_by_agent: true`;
  a Conflict row is still written (so `conflict_id` is always there) and is
  closed at once with the comment "returned to the agent";
- otherwise the Conflict stays `open`, assigned to a group (`group:<name>` or
  the resource's owner group for `owner`), until a person resolves it.
"""

from __future__ import annotations

import copy
import uuid
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Approval,
    ApprovalDecision,
    ApprovalStatus,
    ApprovalSubject,
    Decision,
    Operation,
    PayloadFormat,
    WriteOperation,
)
from approvals.outbox import enqueue_action_execution, notify_action_on_commit
from approvals.services.decisions import (
    action_transition,
    answers_for_agent,
)
from audit.services import Actor, audit_append
from console.core.errors import Forbidden, InvalidTransition, NotFound, ValidationFailed
from console.permissions import resolver_group, user_groups
from ownership.diff import apply_merge_patch, merge_documents, three_way_diff
from ownership.models import (
    ApprovalMode,
    Conflict,
    ConflictClass,
    ConflictOrigin,
    ConflictStatus,
    OnConflict,
    OwnershipRecord,
    ResolutionChoice,
    Resource,
    ResourceVersion,
)

AGENT_RETURNED_COMMENT = "returned to the agent (retryable_by_agent)"
MAX_COMMENT_LENGTH = 2000


def document_at(resource: Resource, version: int | None) -> dict[str, Any]:
    """The resource's document as of `version` (from its ResourceVersion snapshot)."""
    if version is None or version == 0:
        return {}
    if version == resource.version:
        return copy.deepcopy(resource.document) if not resource.deleted else {}
    row = ResourceVersion.objects.filter(resource=resource, version=version).first()
    if row is None or row.deleted:
        return {}
    return copy.deepcopy(row.document)


def proposed_document(action: Action, base: dict[str, Any]) -> dict[str, Any]:
    """What the action's write would have produced from the document it observed."""
    if action.payload_format == PayloadFormat.MERGE_PATCH:
        result = apply_merge_patch(base, action.payload)
        return result if isinstance(result, dict) else {}
    if action.payload_format == PayloadFormat.DELETE or action.operation == WriteOperation.DELETE:
        return {}
    return copy.deepcopy(action.payload) if isinstance(action.payload, dict) else {}


def conflict_payload(*, action: Action, conflict: Conflict, cls: ConflictClass) -> dict[str, Any]:
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


def run_holds_lease(*, action: Action, now: Any) -> bool:
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
            .filter(pk=action_id, status__in=(ActionStatus.QUEUED, ActionStatus.EXECUTING))
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
                from_statuses=(ActionStatus.QUEUED, ActionStatus.EXECUTING),
                to_status=ActionStatus.FAILED,
                error={"code": "not_found", "resource": action.resource_identifier},
            )
            return None
        cls = action.conflict_class
        base_version = action.observed_version or 0
        base = document_at(resource, base_version)
        current = copy.deepcopy(resource.document) if not resource.deleted else {}
        proposed = proposed_document(action, base)
        group = resolver_group(cls.resolver, resource.owner_group)
        agent_resolves = cls.retryable_by_agent
        now = timezone.now()
        conflict = Conflict.objects.create(
            action=action,
            resource=resource,
            conflict_class=cls,
            origin=ConflictOrigin.WRITE,
            resolver=cls.resolver,
            resolver_group=group,
            status=ConflictStatus.RESOLVED if agent_resolves else ConflictStatus.OPEN,
            resolved_at=now if agent_resolves else None,
            resolution_comment=AGENT_RETURNED_COMMENT if agent_resolves else "",
            base_version=min(base_version, resource.version),
            base_document=base,
            current_version=resource.version,
            current_document=current,
            proposed_document=proposed,
            fields=three_way_diff(base, current, proposed),
        )
        payload = conflict_payload(action=action, conflict=conflict, cls=cls)
        if cls.on_conflict == OnConflict.STOP_UNLESS_LEASE:
            # Tell the resolver whether the run held an explicit lease: with one,
            # nobody else could have written, so the later version is the run's own.
            payload["lease_covered"] = run_holds_lease(action=action, now=now)
        action_transition(
            action_id=action.pk,
            from_statuses=(ActionStatus.QUEUED, ActionStatus.EXECUTING),
            to_status=ActionStatus.CONFLICT,
            error=payload,
            resource=resource,
        )
        if operation_id is not None:
            Operation.objects.filter(pk=operation_id, status="pending").update(
                status="failed", finished_at=now, outcome={"refused": refusal}
            )
        audit_append(
            event_type="conflict.opened",
            actor=Actor.system("worker"),
            resource=action.resource_identifier,
            run_id=action.run_id,
            action_id=action.pk,
            details={
                "conflict": str(conflict.pk),
                "conflict_class": cls.slug,
                "resolver": cls.resolver,
                "resolver_group": group,
                "retryable_by_agent": agent_resolves,
                "base_version": base_version,
                "current_version": resource.version,
                "fields": [row["path"] for row in conflict.fields],
                "lease_covered": payload.get("lease_covered"),
            },
        )
    return conflict


def conflict_open_for_undo(
    *, action: Action, resource: Resource, undone_operation: Operation, requested_by: str
) -> Conflict:
    """An undo that found a later write: a person decides (caller's transaction).

    base = the version the action produced, current = now, proposed = the
    document from before the action (what the undo would restore).
    """
    cls = action.conflict_class
    group = resolver_group(cls.resolver, resource.owner_group) or resource.owner_group
    base_version = undone_operation.result_version or resource.version
    base = document_at(resource, base_version)
    current = copy.deepcopy(resource.document) if not resource.deleted else {}
    proposed = document_at(resource, undone_operation.base_version)
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
        current_version=resource.version,
        current_document=current,
        proposed_document=proposed,
        fields=three_way_diff(base, current, proposed),
    )
    audit_append(
        event_type="conflict.opened",
        actor=Actor.system("worker"),
        resource=action.resource_identifier,
        run_id=action.run_id,
        action_id=action.pk,
        details={
            "conflict": str(conflict.pk),
            "origin": "undo",
            "resolver_group": group,
            "requested_by": requested_by,
            "base_version": base_version,
            "current_version": resource.version,
        },
    )
    notify_action_on_commit(action.pk)
    return conflict


def _validate_choices(conflict: Conflict, fields: dict[str, Any] | None) -> dict[str, str]:
    fields = fields or {}
    if not isinstance(fields, dict):
        raise ValidationFailed(
            "fields must be an object of JSON pointer -> 'current' | 'proposed'",
            extra={"errors": [{"field": "fields", "message": "must be an object"}]},
        )
    known = {row["path"] for row in conflict.fields}
    errors = []
    for path, side in fields.items():
        if path not in known:
            errors.append({"field": f"fields.{path}", "message": "not a field of this conflict"})
        elif side not in ("current", "proposed"):
            errors.append({"field": f"fields.{path}", "message": "must be 'current' or 'proposed'"})
    if errors:
        raise ValidationFailed("Invalid merge choices.", extra={"errors": errors})
    return dict(fields)


def conflict_merge_preview(*, conflict: Conflict, fields: dict[str, Any] | None) -> dict[str, Any]:
    """The document a merge with these per-field choices would write (for the page)."""
    choices = _validate_choices(conflict, fields)
    return merge_documents(
        current=conflict.current_document,
        proposed=conflict.proposed_document,
        fields=conflict.fields,
        choices=choices,  # type: ignore[arg-type]
    )


def _undo_requester(conflict: Conflict) -> str:
    """The person (id) who asked for the undo that became this conflict, if any."""
    if conflict.origin != ConflictOrigin.UNDO:
        return ""
    from audit.models import ActorType, AuditEvent

    event = (
        AuditEvent.objects.filter(
            event_type="undo.requested", action_id=conflict.action_id, actor_type=ActorType.PERSON
        )
        .order_by("seq")
        .first()
    )
    return event.actor_id if event is not None else ""


def conflict_resolve(
    *,
    conflict_id: uuid.UUID | str,
    person: Any,
    choice: str,
    fields: dict[str, Any] | None = None,
    comment: str = "",
) -> Conflict:
    """Settle an open conflict. Resolver group members only.

    keep_current closes it; take_proposed / merge create a NEW action (parent =
    the original, payload_format `resolution`, the full document, observed =
    the current version; a `delete` when taking the proposed side of a delete or
    of the undo of a create) approved by this decision and enqueued on commit.
    For a per-call class with quorum > 1 this decision is the first vote: the new
    action waits `pending_approval` on a pending approval (the class's quorum and
    TTL) until approval_decide reaches the quorum.
    Raises NotFound, Forbidden (`forbidden` / `self_approval`),
    ValidationFailed (422), InvalidTransition (409, already resolved).
    """
    if choice not in ResolutionChoice.values:
        raise ValidationFailed(
            "choice must be keep_current, take_proposed or merge",
            extra={"errors": [{"field": "choice", "message": "unknown choice"}]},
        )
    comment = (comment or "").strip()
    if len(comment) > MAX_COMMENT_LENGTH:
        raise ValidationFailed(
            "comment too long", extra={"errors": [{"field": "comment", "message": "too long"}]}
        )
    try:
        conflict_uuid = uuid.UUID(str(conflict_id))
    except ValueError as exc:
        raise NotFound("No such conflict.") from exc
    with transaction.atomic():
        conflict = (
            Conflict.objects.select_for_update(of=("self",))
            .select_related(
                "action__agent", "action__run", "action__kind", "conflict_class", "resource"
            )
            .filter(pk=conflict_uuid)
            .first()
        )
        if conflict is None:
            raise NotFound("No such conflict.")
        if not conflict_may_resolve(conflict=conflict, person=person):
            raise Forbidden("Only the conflict's resolver group may resolve it.", code="forbidden")
        action = conflict.action
        if conflict.conflict_class.forbid_agent_owner_approval and answers_for_agent(
            agent=action.agent, person=person
        ):
            raise Forbidden(
                "You own the agent that made this write; someone else must resolve it.",
                code="self_approval",
            )
        if _undo_requester(conflict) == str(person.pk):
            raise Forbidden(
                "You requested this undo; someone else must resolve it.", code="self_approval"
            )
        if conflict.status != ConflictStatus.OPEN:
            raise InvalidTransition(
                f"This conflict is already {conflict.status}.", code="already_decided"
            )
        choices = _validate_choices(conflict, fields) if choice == ResolutionChoice.MERGE else {}
        now = timezone.now()
        new_action: Action | None = None
        if choice != ResolutionChoice.KEEP_CURRENT:
            if choice == ResolutionChoice.TAKE_PROPOSED:
                document = copy.deepcopy(conflict.proposed_document)
            else:
                document = merge_documents(
                    current=conflict.current_document,
                    proposed=conflict.proposed_document,
                    fields=conflict.fields,
                    choices=choices,  # type: ignore[arg-type]
                )
            # Taking the proposed side of a delete, or of the undo of a create (the
            # undo would have left a tombstone), deletes. A merge always writes the
            # merged document (for the undo of a create: the current document minus
            # the fields the resolver took from the empty "before" side).
            deleting = choice == ResolutionChoice.TAKE_PROPOSED and (
                (
                    conflict.origin == ConflictOrigin.WRITE
                    and action.operation == WriteOperation.DELETE
                )
                or (
                    conflict.origin == ConflictOrigin.UNDO
                    and action.operation == WriteOperation.CREATE
                )
            )
            cls = conflict.conflict_class
            # A class that needs more than one person keeps needing them: the
            # resolver's decision is the first vote; the action waits
            # `pending_approval` until approval_decide reaches the quorum.
            needs_more_votes = cls.approval_mode == ApprovalMode.PER_CALL and cls.quorum > 1
            new_action = Action.objects.create(
                run=action.run,
                agent=action.agent,
                kind=action.kind,
                name=action.name,
                resource=conflict.resource,
                operation=WriteOperation.DELETE if deleting else WriteOperation.UPDATE,
                payload_format=PayloadFormat.DELETE if deleting else PayloadFormat.RESOLUTION,
                payload=None if deleting else document,
                observed_version=conflict.current_version,
                conflict_class=conflict.conflict_class,
                status=ActionStatus.PENDING_APPROVAL if needs_more_votes else ActionStatus.QUEUED,
                reason=f"resolution of conflict {conflict.pk}"[:500],
                parent=action,
            )
            if needs_more_votes:
                approval = Approval.objects.create(
                    subject=ApprovalSubject.ACTION,
                    run=action.run,
                    action=new_action,
                    status=ApprovalStatus.PENDING,
                    quorum=cls.quorum,
                    observed_version=conflict.current_version,
                    expires_at=now + timedelta(seconds=cls.approval_ttl_seconds),
                    escalate_at=(
                        now + timedelta(seconds=cls.escalation_seconds)
                        if cls.escalation_seconds
                        else None
                    ),
                    from_conflict=conflict,
                )
            else:
                approval = Approval.objects.create(
                    subject=ApprovalSubject.ACTION,
                    run=action.run,
                    action=new_action,
                    status=ApprovalStatus.APPROVED,
                    quorum=1,
                    observed_version=conflict.current_version,
                    expires_at=now,
                    decided_at=now,
                    from_conflict=conflict,
                )
            ApprovalDecision.objects.create(
                approval=approval, person=person, decision=Decision.APPROVE, comment=comment
            )
        Conflict.objects.filter(pk=conflict.pk).update(
            status=ConflictStatus.RESOLVED,
            resolution=choice,
            resolution_fields=choices,
            resolution_comment=comment,
            resolved_by=person,
            resolved_at=now,
            resolution_action=new_action,
        )
        resolution = {
            "conflict_id": str(conflict.pk),
            "choice": choice,
            "by": person.get_username(),
            "comment": comment,
            "at": now.isoformat(),
            "action": str(new_action.pk) if new_action else None,
        }
        error = dict(action.error or {}) if isinstance(action.error, dict) else {}
        error["resolution"] = resolution
        Action.objects.filter(pk=action.pk).update(
            error=error, revision=action.revision + 1, updated_at=now
        )
        notify_action_on_commit(action.pk)
        audit_append(
            event_type="conflict.resolved",
            actor=Actor.person(person),
            resource=action.resource_identifier,
            run_id=action.run_id,
            action_id=action.pk,
            details={
                "conflict": str(conflict.pk),
                "choice": choice,
                "fields": choices,
                "comment": comment,
                "resolution_action": str(new_action.pk) if new_action else None,
            },
        )
        if new_action is not None:
            audit_append(
                event_type="action.proposed",
                actor=Actor.person(person),
                resource=new_action.resource_identifier,
                run_id=new_action.run_id,
                action_id=new_action.pk,
                details={
                    "parent": str(action.pk),
                    "from_conflict": str(conflict.pk),
                    "choice": choice,
                },
            )
            if new_action.status == ActionStatus.PENDING_APPROVAL:
                audit_append(
                    event_type="approval.requested",
                    actor=Actor.system(),
                    resource=new_action.resource_identifier,
                    run_id=new_action.run_id,
                    action_id=new_action.pk,
                    details={
                        "approval": str(approval.pk),
                        "subject": "action",
                        "quorum": approval.quorum,
                        "votes": 1,
                        "from_conflict": str(conflict.pk),
                        "observed_version": conflict.current_version,
                        "conflict_class": conflict.conflict_class.slug,
                    },
                )
            else:
                new_id = new_action.pk
                transaction.on_commit(lambda: enqueue_action_execution(new_id))
    conflict.refresh_from_db()
    return conflict


def conflict_may_resolve(*, conflict: Conflict, person: Any) -> bool:
    """Is the person in the group this conflict is assigned to?"""
    if not getattr(person, "is_active", False) or not conflict.resolver_group:
        return False
    return conflict.resolver_group in user_groups(person)
