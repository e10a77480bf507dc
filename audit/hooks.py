"""After-append callbacks: the one seam through which another app (notifications) acts on
an audit event in the event's own transaction.

audit imports no other app, so an app that must act on some events in the same
transaction (write its own outbox rows) registers here from its AppConfig.ready(). The
hot path pays one dict lookup per event: callbacks run only for the event types they
named. A callback runs inside the caller's transaction, after the event is appended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from audit.models import AuditEvent

AfterAppend = Callable[[AuditEvent], None]
_AFTER_APPEND: dict[str, list[AfterAppend]] = {}


def audit_after_append(event_types: Iterable[str], callback: AfterAppend) -> None:
    """Call `callback(event)` after each append of one of `event_types`, in the appending
    transaction (and at the end of an `audit_deferred` block for the events it held)."""
    for event_type in event_types:
        callbacks = _AFTER_APPEND.setdefault(event_type, [])
        if callback not in callbacks:
            callbacks.append(callback)


def after_append(event: AuditEvent) -> AuditEvent:
    """Run the callbacks registered for this event's type (audit.services calls it)."""
    callbacks = _AFTER_APPEND.get(event.event_type)
    if callbacks:
        for callback in callbacks:
            callback(event)
    return event
