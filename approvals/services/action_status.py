"""`action_transition`: the one way the engine moves an action's status."""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import F
from django.utils import timezone

from approvals.models import Action
from approvals.outbox import notify_action_on_commit


def action_transition(
    *,
    action_id: uuid.UUID,
    from_statuses: tuple[str, ...],
    to_status: str,
    **fields: Any,
) -> bool:
    """Conditional UPDATE of an action's status (the only way the engine moves one).

    Returns False when the action was not in `from_statuses` (someone else won).
    Bumps the revision (the action's ETag) and schedules the long-poll wake-up.
    """
    updated = Action.objects.filter(pk=action_id, status__in=from_statuses).update(
        status=to_status, revision=F("revision") + 1, updated_at=timezone.now(), **fields
    )
    if updated:
        notify_action_on_commit(action_id)
    return bool(updated)
