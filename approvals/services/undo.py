"""Undo of an applied action: request (API/pages) and execution (job).

`action_undo_request` records the one undo operation of the action's applied
operation (Operation.undo_of is unique: however many requests, one undo) and
enqueues its job on commit. The job takes the resource lock and a fresh fence
and calls the core's `apply_undo`; if someone wrote since, the undo becomes a
conflict for a person (origin `undo`) instead of restoring an old snapshot.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import redis
from django.db import DatabaseError, transaction
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus, Run, RunStatus
from audit.models import ActorType
from audit.services import Actor, audit_append
from console.core.errors import (
    Forbidden,
    InvalidTransition,
    KillSwitchEngaged,
    LockBusy,
    NotFound,
    UndoRefused,
    UndoWindowExpired,
)
from console.permissions import can_undo_as_person
from ownership.models import Resource, TargetType

log = logging.getLogger("airlock.undo")


def _normalise_actor(actor: Any) -> tuple[Actor, Run | None, Any]:
    """(audit actor, run or None, person or None) from a Run, a User or an audit Actor."""
    from django.contrib.auth import get_user_model

    if isinstance(actor, Run):
        return Actor.run(actor), actor, None
    if isinstance(actor, Actor):
        if actor.type == ActorType.RUN:
            run = Run.objects.select_related("agent").filter(pk=actor.id).first()
            if run is None:
                raise Forbidden("Unknown run.", code="forbidden")
            return actor, run, None
        if actor.type == ActorType.PERSON:
            person = get_user_model().objects.filter(pk=actor.id).first()
            if person is None:
                raise Forbidden("Unknown person.", code="forbidden")
            return actor, None, person
        raise Forbidden("Only the action's run or a person may undo.", code="forbidden")
    if getattr(actor, "is_authenticated", False):
        return Actor.person(actor), None, actor
    raise Forbidden("Only the action's run or a person may undo.", code="forbidden")


def action_undo_request(
    *, action_id: uuid.UUID | str, actor: Any, idempotency_key: str = ""
) -> Operation:
    """Ask for the undo of an applied action; returns its (single) undo operation.

    `actor`: the action's Run (run token), a person (User), or an audit Actor of
    either. Raises NotFound, Forbidden, UndoWindowExpired (409
    `undo_window_expired`), InvalidTransition (409: nothing applied to undo).
    Repeating the request returns the same undo operation, with no new audit row.
    """
    from console.core.barrier import open_operation
    from console.core.fence import next_fence

    audit_actor, run, person = _normalise_actor(actor)
    try:
        action_uuid = uuid.UUID(str(action_id))
    except ValueError as exc:
        raise NotFound("No such action.") from exc
    action = Action.objects.select_related("kind", "run").filter(pk=action_uuid).first()
    if action is None:
        raise NotFound("No such action.")
    owner_group = action.resource.owner_group if action.resource else action.kind.owner_group
    if run is not None:
        if run.pk != action.run_id:
            # Another run's action: it may not even know it exists.
            raise NotFound("No such action.")
    elif not (
        getattr(person, "is_active", False) and can_undo_as_person(person, owner_group=owner_group)
    ):
        raise Forbidden(
            "Undo needs the operator role or membership of the resource's owner group.",
            code="forbidden",
        )
    if action.kind.target == TargetType.HTTP:
        raise UndoRefused(
            "Undo is not available for resources of an external HTTP target.",
            extra={"resource": action.resource_identifier},
        )
    with transaction.atomic():
        if run is not None:
            # A run token undoes only while its run is active (a revoked run's
            # token is no credential for production changes). FOR SHARE on the run:
            # a revoke committing first is seen, one arriving later waits for us.
            from approvals.services.runs import RunNotActive
            from console.core.barrier import lock_run_for_share

            run_state = lock_run_for_share(run.pk)
            if (
                run_state is None
                or run_state[0] != RunStatus.ACTIVE
                or (run_state[1] is not None and run_state[1] <= timezone.now())
            ):
                raise RunNotActive(
                    f"Run {run.pk} is not active; only an active run's token may undo.",
                    extra={"run": str(run.pk)},
                )
        locked = Action.objects.select_for_update(of=("self",)).get(pk=action.pk)
        original = (
            Operation.objects.filter(
                action=locked, undo_of__isnull=True, status__in=("done", "undone")
            )
            .order_by("-started_at")
            .first()
        )
        if original is None:
            raise InvalidTransition(
                f"The action is {locked.status}; there is no applied write to undo.",
                code="invalid_transition",
            )
        existing = Operation.objects.filter(undo_of=original).first()
        if existing is not None:
            return existing
        if original.undo_deadline is None or timezone.now() >= original.undo_deadline:
            raise UndoWindowExpired(
                "The undo window of this action has closed.",
                extra={"undo_deadline": original.undo_deadline},
            )
        undo_op = open_operation(
            action_id=locked.pk,
            fence=next_fence(),
            worker="undo-request",
            lease_seconds=0,
            undo_of_id=original.pk,
        )
        Operation.objects.filter(pk=undo_op.pk).update(
            lease_expires_at=None,
            outcome={
                "requested_by": audit_actor.label,
                "requested_by_type": audit_actor.type,
                "requested_by_person": str(person.pk) if person is not None else "",
                "idempotency_key": idempotency_key[:255],
            },
        )
        audit_append(
            event_type="undo.requested",
            actor=audit_actor,
            resource=locked.resource_identifier,
            run_id=locked.run_id,
            action_id=locked.pk,
            details={"operation": original.pk, "undo_operation": undo_op.pk},
        )
        from approvals.jobs import enqueue_undo_execution

        undo_id = undo_op.pk
        transaction.on_commit(lambda: enqueue_undo_execution(undo_id))
    undo_op.refresh_from_db()
    return undo_op


def _retry_undo(undo_op: Operation, reason: str, connection: redis.Redis | None) -> str:
    from approvals.jobs import enqueue_undo_execution
    from approvals.services.execution import MAX_ATTEMPTS, backoff_seconds

    outcome = dict(undo_op.outcome or {})
    attempts = int(outcome.get("attempts", 0)) + 1
    outcome["attempts"] = attempts
    outcome["last_retry_reason"] = reason
    if attempts >= MAX_ATTEMPTS:
        outcome["reason"] = reason
        Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING).update(
            status=OperationStatus.FAILED, outcome=outcome, finished_at=timezone.now()
        )
        return "failed"
    Operation.objects.filter(pk=undo_op.pk, status=OperationStatus.PENDING).update(
        outcome=outcome, lease_expires_at=None
    )
    enqueue_undo_execution(
        undo_op.pk, delay_seconds=backoff_seconds(attempts), connection=connection
    )
    return "retry"


def undo_execute(*, undo_operation_id: int, connection: redis.Redis | None = None) -> str:
    """The undo job: lock, fresh fence, apply_undo; a moved resource opens a conflict."""
    from approvals.jobs import engine_redis
    from approvals.services.execution import (
        lock_ttl_ms,
        operation_lease_seconds,
        worker_name,
    )
    from console.core.barrier import open_operation
    from console.core.lock import FencedLock
    from console.core.undo import RESOURCE_MOVED, STALE_FENCE, apply_undo
    from ownership.services import conflict_open_for_undo

    undo_op = (
        Operation.objects.select_related("undo_of", "action__kind", "action__conflict_class")
        .filter(pk=undo_operation_id, undo_of__isnull=False)
        .first()
    )
    if undo_op is None or undo_op.status != OperationStatus.PENDING:
        return "skipped"
    action = undo_op.action
    conn = connection or engine_redis()
    lock = FencedLock(conn, key=action.resource_identifier, ttl_ms=lock_ttl_ms())
    try:
        fence = lock.acquire(wait_seconds=0.2)
    except (LockBusy, redis.RedisError, DatabaseError) as exc:
        return _retry_undo(undo_op, type(exc).__name__, connection)
    try:
        lock.start_heartbeat()
        requested = dict(undo_op.outcome or {})
        undo_op = open_operation(
            action_id=action.pk,
            fence=fence,
            worker=worker_name(),
            lease_seconds=operation_lease_seconds(),
            undo_of_id=undo_op.undo_of_id,
        )
        if undo_op.status != OperationStatus.PENDING:
            return "skipped"
        actor = Actor(
            type=str(requested.get("requested_by_type") or ActorType.SYSTEM),
            id=str(requested.get("requested_by_person") or ""),
            label=str(requested.get("requested_by") or "undo"),
        )
        if actor.type == ActorType.RUN:
            actor = Actor.run(action.run)
        try:
            lock.check()
            outcome = apply_undo(
                operation_id=undo_op.undo_of_id,  # type: ignore[arg-type]
                undo_operation_id=undo_op.pk,
                fence=fence,
                actor=actor,
            )
        except KillSwitchEngaged:
            return _retry_undo(undo_op, "kill_switch_engaged", connection)
        except Exception as exc:  # lock lost, transient database/redis errors
            if isinstance(exc, (redis.RedisError, DatabaseError)) or getattr(
                exc, "retryable", False
            ):
                return _retry_undo(undo_op, type(exc).__name__, connection)
            raise
        if outcome.applied:
            from approvals.services.decisions import notify_action_on_commit

            with transaction.atomic():
                notify_action_on_commit(action.pk)
            return "undone"
        if outcome.reason == STALE_FENCE:
            return _retry_undo(undo_op, STALE_FENCE, connection)
        if outcome.reason == RESOURCE_MOVED:
            with transaction.atomic():
                resource = Resource.objects.get(pk=int(action.resource_id or 0))
                original = Operation.objects.get(pk=int(undo_op.undo_of_id or 0))
                conflict_open_for_undo(
                    action=action,
                    resource=resource,
                    undone_operation=original,
                    requested_by=str(requested.get("requested_by") or ""),
                )
            return "conflict"
        return f"refused:{outcome.reason}"
    finally:
        try:
            lock.release()
        except redis.RedisError:
            log.warning("could not release the lock on %s", action.resource_identifier)


def undo_status(action: Action) -> dict[str, Any] | None:
    """The undo state of an action for API/pages: None when never requested."""
    undo_op = (
        Operation.objects.filter(action=action, undo_of__isnull=False)
        .order_by("-started_at")
        .first()
    )
    if undo_op is None:
        return None
    conflict = action.conflicts.filter(origin="undo").first()
    return {
        "operation": undo_op.pk,
        "status": undo_op.status,
        "requested_by": (undo_op.outcome or {}).get("requested_by", ""),
        "conflict_id": str(conflict.pk) if conflict else None,
        "action_status": ActionStatus(action.status).value,
    }
