"""The one representation of an audit event: the API's items and the JSON Lines export."""

from __future__ import annotations

from typing import Any

from audit.models import AuditEvent


def event_json(event: AuditEvent) -> dict[str, Any]:
    """The event as the API's AuditEventOut (keys `run` and `action`, like every
    other API object); the hash covers the same values under `run_id`/`action_id`."""
    return {
        "seq": event.seq,
        "created_at": event.created_at.isoformat(),
        "actor_type": event.actor_type,
        "actor_id": event.actor_id,
        "actor_label": event.actor_label,
        "request_id": event.request_id,
        "event_type": event.event_type,
        "resource": event.resource,
        "run": str(event.run_id) if event.run_id else None,
        "action": str(event.action_id) if event.action_id else None,
        "details": event.details,
        "prev_hash": event.prev_hash,
        "hash": event.hash,
    }
