"""One attempt of a write against an external HTTP target (console.core.targets).

An external target has no barrier transaction: the run and the kill switch are
re-checked right before sending (a revoke or an engage that commits while the
request is in flight cannot recall it). A timeout after sending leaves the
operation `unknown`; the next attempt replays with the same Idempotency-Key and
settles it, so one effect is recorded once.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from approvals.services.action_status import action_transition
from approvals.services.attempts import (
    WORKER_ACTOR,
    action_fail,
    action_pause,
    action_retry_later,
    attempt_superseded,
    audit_worker_event,
    claim,
    operation_fail_pending,
    renew_operation_lease,
    route_refusal,
)
from console.core import targets
from console.core.barrier import refuse_if_run_ended
from console.core.errors import LockLost
from console.core.killswitch import engaged_switch_for
from ownership.models import Resource, ResourceVersion

log = logging.getLogger("airlock.execution")


def _mirror_resource(action: Action, response: Any) -> Resource | None:
    """Keep a local mirror row of an external resource (for conflicts and pages)."""
    version = response.version
    document = response.document if isinstance(response.document, dict) else {}
    resource = Resource.objects.filter(kind=action.kind, name=action.name).first()
    if version is None:
        return resource
    if resource is None:
        resource, _ = Resource.objects.get_or_create(
            kind=action.kind,
            name=action.name,
            defaults={
                "document": document,
                "version": version,
                "owner_group": action.kind.owner_group,
            },
        )
    elif version > resource.version or response.status == 404:
        Resource.objects.filter(pk=resource.pk, version__lt=version).update(
            document=document, version=version, deleted=False, updated_at=timezone.now()
        )
        resource.refresh_from_db()
    return resource


def execute_http(*, action: Action, lock: Any, fence: int) -> str:
    """One attempt against an external HTTP target; returns a short outcome."""
    operation = claim(action, fence)
    if isinstance(operation, str):
        return operation
    if refuse_if_run_ended(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
    ):
        return "run_not_active"
    switch = engaged_switch_for(action.resource_identifier)
    if switch is not None:
        operation_fail_pending(operation.pk, {"refused": "kill_switch_engaged"})
        action_pause(action_id=action.pk, reason=switch.reason, scope=switch.scope)
        return "paused"
    target = targets.HttpTarget(action.kind.target_url)
    # The call may outlast the operation's lease (lock TTL + 2 s): renew the lease
    # with the lock, so the reconciler never abandons a request still in flight.
    lock.on_renew(partial(renew_operation_lease, operation.pk))
    response = _send(action=action, operation=operation, lock=lock, fence=fence, target=target)
    if isinstance(response, str):
        return response
    outcome = response.outcome
    if outcome == targets.APPLIED:
        return _record_applied(action=action, operation=operation, fence=fence, response=response)
    if outcome in (targets.STALE, targets.CONFLICT, targets.NOT_FOUND):
        return _record_refused(action=action, operation=operation, target=target, response=response)
    if outcome in (targets.LOCKED, targets.BACKOFF):
        action_retry_later(
            action_id=action.pk,
            reason=f"target_status_{response.status}",
            operation_id=operation.pk,
        )
        return "retry"
    return _fail(action, operation, "target_error", response)


def _send(
    *, action: Action, operation: Operation, lock: Any, fence: int, target: targets.HttpTarget
) -> Any:
    """The target's response, or the attempt's short outcome when nothing came back."""
    try:
        lock.check()
        return target.write(
            name=action.name,
            operation=action.operation,
            payload_format=action.payload_format,
            payload=action.payload,
            observed_version=action.observed_version,
            idempotency_key=targets.idempotency_key_for(action.pk),
            fence=fence,
        )
    except LockLost:
        action_retry_later(action_id=action.pk, reason="lock_lost", operation_id=operation.pk)
        return "lock_lost"
    except targets.TargetNotSent as exc:
        action_retry_later(
            action_id=action.pk, reason=f"target_unreachable: {exc}", operation_id=operation.pk
        )
        return "retry"
    except targets.TargetOutcomeUnknown as exc:
        # It may have been applied: the operation is `unknown`; the next attempt
        # replays with the same Idempotency-Key and settles it.
        with transaction.atomic():
            if attempt_superseded(operation.pk):
                return "superseded"
            Operation.objects.filter(pk=operation.pk, status=OperationStatus.PENDING).update(
                status=OperationStatus.UNKNOWN,
                outcome={"unknown": str(exc)},
            )
            audit_worker_event(
                "write.unknown",
                action,
                {"operation_id": operation.pk, "fence": fence, "error": str(exc)},
            )
        action_retry_later(
            action_id=action.pk, reason="target_timeout_after_send", operation_id=operation.pk
        )
        return "unknown"


def _record_applied(*, action: Action, operation: Operation, fence: int, response: Any) -> str:
    now = timezone.now()
    with transaction.atomic():
        # Lock this attempt's operation, then the action (the barrier's and the
        # reconciler's order). A worker that was paused past its lease resumes
        # here after the reconciler closed its operation and another delivery
        # may already have recorded the effect: it records nothing but closing
        # its own operation (conditionally), so one effect is recorded once.
        mine = Operation.objects.select_for_update().filter(pk=operation.pk).first()
        locked = Action.objects.select_for_update(of=("self",)).get(pk=action.pk)
        if (
            mine is None
            or mine.status != OperationStatus.PENDING
            or locked.status != ActionStatus.EXECUTING
        ):
            operation_fail_pending(
                operation.pk, {"superseded": True, "replayed": response.replayed}
            )
            log.info("action %s: stale delivery of operation %s", action.pk, operation.pk)
            return "superseded"
        resource = _mirror_resource(action, response)
        effect_op = _settle_unknown(action=action, operation=operation, response=response)
        settled = Operation.objects.filter(
            pk=effect_op.pk, status__in=(OperationStatus.PENDING, OperationStatus.UNKNOWN)
        ).update(
            status=OperationStatus.DONE,
            base_version=action.observed_version,
            result_version=response.version,
            finished_at=now,
            outcome={
                "result": "applied",
                "target_status": response.status,
                "replayed": response.replayed,
                "settled_by": operation.pk if effect_op.pk != operation.pk else None,
            },
        )
        if not settled:  # cannot happen under the locks above; never record twice
            return "superseded"
        if resource is not None and response.version is not None:
            ResourceVersion.objects.get_or_create(
                resource=resource,
                version=response.version,
                defaults={
                    "document": response.document if isinstance(response.document, dict) else {},
                    "operation": action.operation,
                    "fence": fence,
                    "run_id": action.run_id,
                    "action_id": action.pk,
                    "deleted": action.operation == "delete",
                },
            )
        moved = action_transition(
            action_id=action.pk,
            from_statuses=(ActionStatus.EXECUTING,),
            to_status=ActionStatus.APPLIED,
            error=None,
            resource=resource,
        )
        assert moved  # the action row is locked and was `executing`
        audit_worker_event(
            "write.applied",
            action,
            {
                "target": "http",
                "operation_id": effect_op.pk,
                "fence": fence,
                "from_version": action.observed_version,
                "to_version": response.version,
                "replayed": response.replayed,
            },
        )
    return "applied"


def _settle_unknown(*, action: Action, operation: Operation, response: Any) -> Operation:
    """The operation that made the effect: a replay settles the earlier `unknown`
    attempt (that one made it), and this attempt's own operation closes as failed."""
    unknown = (
        Operation.objects.select_for_update()
        .filter(action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN)
        .order_by("started_at")
        .first()
    )
    if unknown is None:
        return operation
    now = timezone.now()
    operation_fail_pending(operation.pk, {"replay_of": unknown.pk, "replayed": response.replayed})
    Operation.objects.filter(
        action=action, undo_of__isnull=True, status=OperationStatus.UNKNOWN
    ).exclude(pk=unknown.pk).update(status=OperationStatus.FAILED, finished_at=now)
    return unknown


def _record_refused(
    *, action: Action, operation: Operation, target: targets.HttpTarget, response: Any
) -> str:
    """Stale, conflicting or missing at the target: mirror what it holds, then route."""
    try:
        current = target.read(action.name)
        with transaction.atomic():
            _mirror_resource(action, current)
    except targets.TargetNotSent:
        pass
    with transaction.atomic():
        if attempt_superseded(operation.pk):
            return "superseded"
        audit_worker_event(
            "write.refused",
            action,
            {"target": "http", "status": response.status, "operation_id": operation.pk},
        )
    if response.outcome == targets.NOT_FOUND and action.operation != "create":
        return _fail(action, operation, "not_found", response)
    return route_refusal(action_id=action.pk, operation_id=operation.pk, refusal="stale_version")


def _fail(action: Action, operation: Operation, code: str, response: Any) -> str:
    action_fail(
        action_id=action.pk,
        code=code,
        reason=f"target answered {response.status}",
        operation_id=operation.pk,
    )
    return "failed"
