"""The audit event about one action: its resource, run and id travel with every one."""

from __future__ import annotations

from typing import Any

from approvals.models import Action
from audit.models import AuditEvent
from audit.services import Actor, EventSpec, audit_append


def action_event(
    action: Action, *, event_type: str, actor: Actor, details: dict[str, Any]
) -> EventSpec:
    """The event about `action`, as audit_append's keyword arguments."""
    return EventSpec(
        event_type=event_type,
        actor=actor,
        resource=action.resource_identifier,
        run_id=action.run_id,
        action_id=action.pk,
        details=details,
    )


def audit_action_event(
    action: Action, *, event_type: str, actor: Actor, details: dict[str, Any]
) -> AuditEvent:
    """Append `event_type` about `action` inside the caller's transaction (audit_append's
    lock rule: keep it the last step)."""
    return audit_append(**action_event(action, event_type=event_type, actor=actor, details=details))
