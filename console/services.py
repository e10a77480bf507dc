"""Kill switch: engage and release (shared by the API and the console pages).

Engaging pauses queued work in the scope at once (`paused` with the reason).
An engage first takes the kill-switch lock exclusively (engine.core.killswitch):
it waits for write transactions already past their kill-switch check (they hold
it shared until commit), and barriers that start later wait for the engage to
commit and then see it, so no managed write commits after an engage returned.
(An HTTP-target write already sent to the target cannot be recalled.)
Releasing re-queues paused actions and resumes paused undos (pending undo
operations a switch held) that no other engaged switch still covers, oldest
first, and enqueues their jobs in that order after commit.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from approvals.outbox import (
    enqueue_action_execution,
    enqueue_undo_execution,
    notify_action_on_commit,
)
from audit.services import Actor, audit_append
from console.models import KillSwitch
from console.permissions import is_operator, require_person
from engine.core.errors import ValidationFailed, text_within
from engine.core.killswitch import lock_switches_exclusive, scope_is_valid

MAX_REASON = 1000


def _covered(action: Action, switches: list[KillSwitch]) -> KillSwitch | None:
    identifier = action.resource_identifier
    for switch in switches:
        if switch.covers(identifier):
            return switch
    return None


def kill_switch_set(*, scope: str, engaged: bool, reason: str, actor: Actor) -> KillSwitch:
    """Engage or release one scope (`*`, `kind/prefix*` or `kind/name`).

    `actor` is a person with the operator role (or admin), or the system
    (management commands). Raises Forbidden, ValidationFailed. Setting a scope
    to the state it is already in changes nothing and writes no audit row.
    Takes the kill-switch lock exclusively, then the switch row, the audit head
    last; enqueues released work after commit.
    """
    person = require_person(actor, is_operator, "Only operators may use the kill switch.")
    scope, reason = _validated(scope, reason, engaged=engaged)
    with transaction.atomic():
        lock_switches_exclusive()  # before the switch row and the audit head
        switch, _ = KillSwitch.objects.select_for_update().get_or_create(scope=scope)
        if switch.engaged == engaged and (not engaged or switch.reason == reason):
            return switch
        switch.engaged = engaged
        switch.reason = reason if engaged else (reason or switch.reason)
        switch.changed_by = person
        switch.save()
        resumed_undos: list[Operation] = []
        if engaged:
            affected = _pause_covered(switch, reason)
        else:
            still_engaged = list(KillSwitch.objects.filter(engaged=True))
            affected = _resume_released(switch, still_engaged)
            resumed_undos = _paused_undos_released_by(switch, still_engaged)
            if resumed_undos:
                Operation.objects.filter(
                    pk__in=[op.pk for op in resumed_undos], status=OperationStatus.PENDING
                ).update(paused_reason="")
        details: dict[str, Any] = {
            "scope": scope,
            "reason": reason,
            ("paused" if engaged else "resumed"): [str(a) for a in affected],
        }
        if resumed_undos:
            details["resumed_undos"] = [op.pk for op in resumed_undos]
        audit_append(
            event_type="kill_switch.engaged" if engaged else "kill_switch.released",
            actor=actor,
            resource=scope,
            details=details,
        )
        for action_id in affected:
            notify_action_on_commit(action_id)
        for undo_op in resumed_undos:
            notify_action_on_commit(undo_op.action_id)
        if affected or resumed_undos:
            _enqueue_released_on_commit(affected if not engaged else [], resumed_undos)
    switch.refresh_from_db()
    return switch


def _validated(scope: str, reason: str, *, engaged: bool) -> tuple[str, str]:
    scope = (scope or "").strip()
    if not scope_is_valid(scope):
        raise ValidationFailed(
            "scope must be '*' or 'kind/prefix*'",
            extra={"errors": [{"field": "scope", "message": "'*' or 'kind/prefix*'"}]},
        )
    reason = text_within(reason, field="reason", limit=MAX_REASON)
    if engaged and not reason:
        raise ValidationFailed(
            "say why you engage the kill switch",
            extra={"errors": [{"field": "reason", "message": "required when engaging"}]},
        )
    return scope, reason


def _pause_covered(switch: KillSwitch, reason: str) -> list[Any]:
    """Queued actions the switch covers -> paused with its reason; their ids."""
    queued = [
        a
        for a in Action.objects.filter(status=ActionStatus.QUEUED).select_related("kind")
        if switch.covers(a.resource_identifier)
    ]
    affected = [a.pk for a in queued]
    if affected:
        Action.objects.filter(pk__in=affected, status=ActionStatus.QUEUED).update(
            status=ActionStatus.PAUSED,
            paused_reason=reason,
            revision=F("revision") + 1,
            updated_at=timezone.now(),
        )
    return affected


def _resume_released(switch: KillSwitch, still_engaged: list[KillSwitch]) -> list[Any]:
    """Paused actions the switch held and no other engaged switch covers -> queued."""
    paused = [
        a
        for a in Action.objects.filter(status=ActionStatus.PAUSED).order_by("created_at")
        if switch.covers(a.resource_identifier) and _covered(a, still_engaged) is None
    ]
    affected = [a.pk for a in paused]
    if affected:
        Action.objects.filter(pk__in=affected, status=ActionStatus.PAUSED).update(
            status=ActionStatus.QUEUED,
            paused_reason="",
            not_before=None,
            revision=F("revision") + 1,
            updated_at=timezone.now(),
        )
    return affected


def _enqueue_released_on_commit(action_ids: list[Any], undos: list[Operation]) -> None:
    """Oldest first across both: an action by when it was proposed, an undo by when
    it was accepted."""
    if not action_ids and not undos:
        return
    created = dict(Action.objects.filter(pk__in=action_ids).values_list("pk", "created_at"))
    ordered: list[tuple[Any, str, Any]] = [
        (created[action_id], "action", action_id) for action_id in action_ids
    ] + [(op.accepted_at or op.started_at, "undo", op.pk) for op in undos]
    ordered.sort(key=lambda entry: entry[0])

    def _enqueue_in_order() -> None:
        for _, what, object_id in ordered:
            if what == "action":
                enqueue_action_execution(object_id)
            else:
                enqueue_undo_execution(object_id)

    transaction.on_commit(_enqueue_in_order)


def _paused_undos_released_by(
    switch: KillSwitch, still_engaged: list[KillSwitch]
) -> list[Operation]:
    """Pending undo operations held by `switch` that no other engaged switch covers."""
    paused = (
        Operation.objects.filter(status=OperationStatus.PENDING, undo_of__isnull=False)
        .exclude(paused_reason="")
        .select_related("action")
        .order_by("accepted_at", "started_at")
    )
    return [
        op
        for op in paused
        if switch.covers(op.action.resource_identifier)
        and not any(other.covers(op.action.resource_identifier) for other in still_engaged)
    ]
