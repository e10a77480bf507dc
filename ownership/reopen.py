"""Reopening a conflict whose resolution never wrote.

A resolution (conflict_resolve) creates an action that carries a person's
decision. If that action is nevertheless cancelled, rejected (a quorum's other
voter said no) or expires before it executes, nothing was written: the conflict
goes back to `open` for its resolver group, with the current document read
again, and the trail says why (`conflict.reopened`).

A leaf: it imports models, the diff, the audit and the outbox's wake-up only, so the
approval, cancel and expiry services can call it without an import cycle
(ownership.services.conflicts and .resolution import approvals.services.decisions);
the resolution service writes a settlement through the same `conflict_resolution_set`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import F
from django.utils import timezone

from approvals.models import Action
from approvals.outbox import notify_action_on_commit
from audit.services import Actor
from engine.core.action_audit import audit_action_event
from ownership.diff import three_way_diff
from ownership.models import Conflict, ConflictStatus
from ownership.targets import current_state


@dataclass(frozen=True)
class Resolution:
    """A conflict's settlement, named as the conflict's columns (UNRESOLVED: none)."""

    resolution: str  # the choice: keep_current, take_proposed or merge
    resolution_fields: dict[str, str]  # a merge's side per field
    resolution_comment: str
    resolved_by: Any  # the resolver (a User)
    resolved_at: datetime | None
    resolution_action: Action | None  # the write that carries it; None for keep_current

    def note(self, conflict: Conflict) -> dict[str, Any] | None:
        """What the conflicted action's `error.resolution` says (the agent reads it)."""
        if not self.resolution:
            return None
        assert self.resolved_at is not None
        written = self.resolution_action
        return {
            "conflict_id": str(conflict.pk),
            "choice": self.resolution,
            "by": self.resolved_by.get_username(),
            "comment": self.resolution_comment,
            "at": self.resolved_at.isoformat(),
            "action": str(written.pk) if written else None,
        }


UNRESOLVED = Resolution("", {}, "", None, None, None)


def conflict_resolution_set(conflict: Conflict, resolution: Resolution, **columns: Any) -> None:
    """The one write of a conflict's resolution (caller's transaction, conflict row
    locked): `resolution` settles it, UNRESOLVED opens it again with every resolution
    column cleared; `columns` ride along in the same UPDATE. The conflicted action notes
    it in `error.resolution` (None once reopened): its ETag moves, its waiters wake."""
    settled = ConflictStatus.RESOLVED if resolution.resolution else ConflictStatus.OPEN
    Conflict.objects.filter(pk=conflict.pk).update(status=settled, **vars(resolution), **columns)
    action = conflict.action
    error = dict(action.error) if isinstance(action.error, dict) else {}
    error["resolution"] = resolution.note(conflict)
    Action.objects.filter(pk=action.pk).update(
        error=error, revision=F("revision") + 1, updated_at=timezone.now()
    )
    notify_action_on_commit(action.pk)


def conflict_reopen_for_resolution(
    *, action_id: uuid.UUID, reason: str, actor: Actor
) -> Conflict | None:
    """Inside the caller's transaction, after the resolution action (`action_id`) ended
    without writing: reopen the conflict it resolved. None when the action resolved no
    conflict (or the conflict is open already). Locks the conflict row, then updates
    the original action; the audit head last."""
    conflict = (
        Conflict.objects.select_for_update(of=("self",))
        .select_related("resource__kind", "action")
        .filter(resolution_action_id=action_id, status=ConflictStatus.RESOLVED)
        .first()
    )
    if conflict is None:
        return None
    resource = conflict.resource
    current, current_version = current_state(resource.kind, resource)
    previous = {
        "choice": conflict.resolution,
        "by": conflict.resolved_by_id,
        "at": conflict.resolved_at.isoformat() if conflict.resolved_at else None,
        "comment": conflict.resolution_comment,
    }
    conflict_resolution_set(
        conflict,
        UNRESOLVED,
        current_version=current_version,
        current_document=current,
        fields=three_way_diff(conflict.base_document, current, conflict.proposed_document),
    )
    audit_action_event(
        conflict.action,
        event_type="conflict.reopened",
        actor=actor,
        details={
            "conflict": str(conflict.pk),
            "resolution_action": str(action_id),
            "reason": reason,
            "previous_resolution": previous,
            "current_version": current_version,
        },
    )
    return conflict
