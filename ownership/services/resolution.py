"""Resolving a conflict: a person of its resolver group keeps the current
document, takes the proposal, or merges field by field.

Anything but keep_current becomes a NEW action (parent = the original,
payload_format `resolution`, the full document, observed = the current
version) carrying that person's decision: approved at once, or — for a
per-call class with quorum > 1 — the first vote on a pending approval
(approvals.services.decisions.approval_open_for_action) that approval_decide
completes.
"""

from __future__ import annotations

import copy
import uuid
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Operation,
    PayloadFormat,
    WriteOperation,
)
from approvals.outbox import (
    enqueue_action_execution,
    enqueue_plan_after_action,
)
from approvals.services.approval_open import (
    approval_open_for_resolution,
    resolution_needs_votes,
)
from approvals.services.decisions import MAX_COMMENT_LENGTH
from approvals.services.separation import answers_for_agent
from audit.models import ActorType, AuditEvent
from audit.services import Actor
from engine.core.action_audit import audit_action_event
from engine.core.actors import acting_person
from engine.core.errors import (
    Forbidden,
    InvalidTransition,
    NotFound,
    ValidationFailed,
    text_within,
)
from ownership.diff import merge_documents
from ownership.models import (
    Conflict,
    ConflictOrigin,
    ConflictStatus,
    ResolutionChoice,
)
from ownership.reopen import Resolution, conflict_resolution_set
from ownership.selectors import conflict_may_resolve


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
    """The document a merge with these per-field choices would write (for the page).

    Raises ValidationFailed for a choice that names no field or no side.
    """
    choices = _validate_choices(conflict, fields)
    return merge_documents(
        current=conflict.current_document,
        proposed=conflict.proposed_document,
        fields=conflict.fields,
        choices=choices,  # type: ignore[arg-type]
    )


def _validate_request(choice: str, comment: str) -> str:
    """The checks that need no row; returns the stripped comment."""
    if choice not in ResolutionChoice.values:
        raise ValidationFailed(
            "choice must be keep_current, take_proposed or merge",
            extra={"errors": [{"field": "choice", "message": "unknown choice"}]},
        )
    return text_within(comment, field="comment", limit=MAX_COMMENT_LENGTH)


def _undo_requester(conflict: Conflict) -> str:
    """The person (id) who asked for the undo that became this conflict, if any."""
    if conflict.origin != ConflictOrigin.UNDO:
        return ""
    event = (
        AuditEvent.objects.filter(
            event_type="undo.requested", action_id=conflict.action_id, actor_type=ActorType.PERSON
        )
        .order_by("seq")
        .first()
    )
    return event.actor_id if event is not None else ""


def _lock_for_resolver(conflict_id: uuid.UUID | str, actor: Actor) -> tuple[Conflict, Any]:
    """Lock the open conflict and check the actor may settle it (caller's transaction).

    Returns the conflict and the acting person. Raises NotFound, Forbidden
    (`forbidden`, `self_approval`), InvalidTransition (`already_decided`).
    """
    try:
        conflict_uuid = uuid.UUID(str(conflict_id))
    except ValueError as exc:
        raise NotFound("No such conflict.") from exc
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
    person = acting_person(actor)
    if person is None or not conflict_may_resolve(conflict=conflict, person=person):
        raise Forbidden("Only the conflict's resolver group may resolve it.", code="forbidden")
    if conflict.conflict_class.forbid_agent_owner_approval and answers_for_agent(
        agent=conflict.action.agent, actor=actor, run=conflict.action.run
    ):
        raise Forbidden(
            "You own or created the agent that made this write, or minted the token that "
            "started its run or a live token of the agent; someone else must resolve it.",
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
    return conflict, person


def _undo_deletes(action: Action) -> bool:
    """The undo of this write leaves a tombstone: it created the resource, or it is a
    plan's compensation that deletes (`restore.deleted`)."""
    restore = (
        Operation.objects.filter(action=action, undo_of__isnull=False, compensation=True)
        .exclude(restore=None)
        .values_list("restore", flat=True)
        .first()
    )
    if isinstance(restore, dict):
        return bool(restore.get("deleted"))
    return action.operation == WriteOperation.CREATE


def _resolution_document(
    conflict: Conflict, choice: str, choices: dict[str, str]
) -> dict[str, Any] | None:
    """The full document the resolution writes; None when it deletes.

    Taking the proposed side of a delete, or of the undo of a create (the undo
    would have left a tombstone), deletes. A merge always writes the merged
    document (for the undo of a create: the current document minus the fields
    the resolver took from the empty "before" side).
    """
    action = conflict.action
    if choice == ResolutionChoice.TAKE_PROPOSED:
        if (
            conflict.origin == ConflictOrigin.WRITE and action.operation == WriteOperation.DELETE
        ) or (conflict.origin == ConflictOrigin.UNDO and _undo_deletes(action)):
            return None
        proposed: dict[str, Any] = copy.deepcopy(conflict.proposed_document)
        return proposed
    return merge_documents(
        current=conflict.current_document,
        proposed=conflict.proposed_document,
        fields=conflict.fields,
        choices=choices,  # type: ignore[arg-type]
    )


def _resolution_action_create(conflict: Conflict, document: dict[str, Any] | None) -> Action:
    """The new action carrying the decision: queued, or waiting for more votes when
    the class needs more than one person (it keeps needing them)."""
    action = conflict.action
    cls = conflict.conflict_class
    needs_more_votes = resolution_needs_votes(cls)
    deleting = document is None
    return Action.objects.create(
        run=action.run,
        agent=action.agent,
        kind=action.kind,
        name=action.name,
        resource=conflict.resource,
        operation=WriteOperation.DELETE if deleting else WriteOperation.UPDATE,
        payload_format=PayloadFormat.DELETE if deleting else PayloadFormat.RESOLUTION,
        payload=document,
        observed_version=conflict.current_version,
        conflict_class=cls,
        status=ActionStatus.PENDING_APPROVAL if needs_more_votes else ActionStatus.QUEUED,
        reason=f"resolution of conflict {conflict.pk}"[:500],
        parent=action,
    )


def _conflict_close(conflict: Conflict, resolution: Resolution, *, actor: Actor) -> None:
    """Mark the conflict resolved, note the resolution on the original action, audit."""
    action, new_action = conflict.action, resolution.resolution_action
    conflict_resolution_set(conflict, resolution)
    # A plan waiting on this conflict (a step's, or a compensation's) goes on.
    transaction.on_commit(partial(enqueue_plan_after_action, action.pk))
    audit_action_event(
        action,
        event_type="conflict.resolved",
        actor=actor,
        details={
            "conflict": str(conflict.pk),
            "choice": resolution.resolution,
            "fields": resolution.resolution_fields,
            "comment": resolution.resolution_comment,
            "resolution_action": str(new_action.pk) if new_action else None,
        },
    )


def _resolution_action_submit(
    conflict: Conflict,
    new_action: Action,
    *,
    choice: str,
    actor: Actor,
    comment: str,
) -> None:
    """Audit the new action and record the resolver's decision as its approval:
    the first vote on a pending approval, or an approval granted at once (then
    the action is enqueued after commit)."""
    audit_action_event(
        new_action,
        event_type="action.proposed",
        actor=actor,
        details={
            "parent": str(conflict.action_id),
            "from_conflict": str(conflict.pk),
            "choice": choice,
        },
    )
    approval_open_for_resolution(action=new_action, conflict=conflict, actor=actor, comment=comment)
    if new_action.status != ActionStatus.PENDING_APPROVAL:
        new_id = new_action.pk
        transaction.on_commit(lambda: enqueue_action_execution(new_id))


def conflict_resolve(
    *,
    conflict_id: uuid.UUID | str,
    actor: Actor,
    choice: str,
    fields: dict[str, Any] | None = None,
    comment: str = "",
) -> Conflict:
    """Settle an open conflict (resolver group members only), in one transaction.

    Locks the conflict row. keep_current closes it; take_proposed / merge create
    the resolution action (see the module docstring), enqueued on commit when no
    more votes are needed. Raises NotFound, Forbidden (`forbidden` /
    `self_approval`), ValidationFailed (422), InvalidTransition (409, already
    resolved).
    """
    comment = _validate_request(choice, comment)
    with transaction.atomic():
        conflict, person = _lock_for_resolver(conflict_id, actor)
        choices = _validate_choices(conflict, fields) if choice == ResolutionChoice.MERGE else {}
        new_action = None
        if choice != ResolutionChoice.KEEP_CURRENT:
            document = _resolution_document(conflict, choice, choices)
            new_action = _resolution_action_create(conflict, document)
        resolution = Resolution(choice, choices, comment, person, timezone.now(), new_action)
        _conflict_close(conflict, resolution, actor=actor)
        if new_action is not None:
            _resolution_action_submit(
                conflict,
                new_action,
                choice=choice,
                actor=actor,
                comment=comment,
            )
    conflict.refresh_from_db()
    return conflict
