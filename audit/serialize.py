"""The one representation of an audit event: the API's items and the JSON Lines export."""

from __future__ import annotations

import json
from typing import Any

from audit.chain import hashed_time
from audit.models import AuditEvent


def event_json(event: AuditEvent) -> dict[str, Any]:
    """The event as the API's AuditEventOut (keys `run` and `action`, like every
    other API object); the hash covers the same values under `run_id`/`action_id`, and
    `created_at` is the very text hashed (docs/audit-chain.md), so anyone can re-hash it."""
    return {
        "seq": event.seq,
        "created_at": hashed_time(event.created_at),
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


# Characters that many line readers (Python's str.splitlines among them) take for a line end,
# which JSON leaves unescaped: escaped, a line stays one line for every reader. They can only
# stand inside JSON strings, where the escape means the same character.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event_jsonl(event: AuditEvent) -> str:
    """One line of the JSON Lines export (the console's and `manage.py audit_export`)."""
    line = json.dumps(event_json(event), ensure_ascii=False, sort_keys=True)
    return line.translate(_LINE_BREAKS) + "\n"
