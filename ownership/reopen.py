"""Reopening a conflict whose resolution never wrote.

A resolution (conflict_resolve) creates an action that carries a person's
decision. If that action is nevertheless cancelled, rejected (a quorum's other
voter said no) or expires before it executes, nothing was written: the conflict
goes back to `open` for its resolver group, with the current document read
again, and the trail says why (`conflict.reopened`).

A leaf: it imports models, the diff and the audit only, so the approval, cancel
and expiry services can call it without an import cycle (ownership.services.conflicts
and .resolution import approvals.services.decisions).
"""

from __future__ import annotations

import copy
import uuid
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import F

from approvals.models import Action
from approvals.notify import notify_action_changed
from audit.services import Actor
from console.core.action_audit import audit_action_event
from ownership.diff import three_way_diff
from ownership.models import Conflict, ConflictStatus


def conflict_reopen_for_resolution(
    *, action_id: uuid.UUID, reason: str, actor: Actor
) -> Conflict | None:
    """Inside the caller's transaction, after the resolution action (`action_id`) ended
    without writing: reopen the conflict it resolved. None when the action resolved no
    conflict (or the conflict is open already). Locks the conflict row, then updates
    the original action; the audit head last."""
    conflict = (
        Conflict.objects.select_for_update(of=("self",))
        .select_related("resource", "action")
        .filter(resolution_action_id=action_id, status=ConflictStatus.RESOLVED)
        .first()
    )
    if conflict is None:
        return None
    resource = conflict.resource
    current: dict[str, Any] = copy.deepcopy(resource.document) if not resource.deleted else {}
    current_version = max(resource.version, conflict.base_version)
    previous = {
        "choice": conflict.resolution,
        "by": conflict.resolved_by_id,
        "at": conflict.resolved_at.isoformat() if conflict.resolved_at else None,
        "comment": conflict.resolution_comment,
    }
    Conflict.objects.filter(pk=conflict.pk).update(
        status=ConflictStatus.OPEN,
        resolution="",
        resolution_fields={},
        resolution_comment="",
        resolved_by=None,
        resolved_at=None,
        resolution_action=None,
        current_version=current_version,
        current_document=current,
        fields=three_way_diff(conflict.base_document, current, conflict.proposed_document),
    )
    original = conflict.action
    error = dict(original.error) if isinstance(original.error, dict) else {}
    error["resolution"] = None
    Action.objects.filter(pk=original.pk).update(error=error, revision=F("revision") + 1)
    transaction.on_commit(partial(notify_action_changed, original.pk))
    audit_action_event(
        original,
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
