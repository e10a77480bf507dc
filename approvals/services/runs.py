"""Runs: creation with a write set, activation, heartbeat, finish, expiry, revocation.

The write-set rules (overlaps, leases, the per-kind advisory locks taken before
any ownership record becomes active) live in `approvals.services.write_sets`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Agent,
    Approval,
    ApprovalStatus,
    Plan,
    PlanStatus,
    Run,
    RunStatus,
    run_end_exempt,
)
from approvals.notify import notify_action_changed, notify_run_changed
from approvals.outbox import enqueue_plan_advance
from approvals.services.approval_open import approval_open_for_run
from approvals.services.plan_state import plans_end_unapproved
from approvals.services.tokens import RUN_PREFIX, token_generate
from approvals.services.write_sets import (
    OPEN_ACTION_STATUSES,
    auto_approved,
    entries_of,
    lock_kinds,
    ownership_records_create,
    raise_on_lease_blockers,
    raise_on_overlap,
    write_set_parse,
)
from audit.models import ActorType
from audit.services import Actor, audit_append
from console.permissions import can_decide_approvals, require_person
from engine.core.errors import DomainError, InvalidTransition, NotFound, ValidationFailed
from engine.core.write_rows import lock_run_for_share
from ownership.models import OwnershipRecord

MIN_TTL_SECONDS = 60
DEFAULT_TTL_SECONDS = 3600


class RunNotActive(DomainError):
    code = "run_not_active"


def _max_ttl() -> int:
    return int(settings.AIRLOCK_RUN_MAX_TTL_SECONDS)


def run_create(
    *,
    agent: Agent,
    task: str,
    write_set: Any,
    ttl_seconds: int | None,
    actor: Actor,
    token_minted_by_id: int | None = None,
    on_created: Callable[[Run, str], None] | None = None,
) -> tuple[Run, str]:
    """Create a run; returns it and its token (shown once).

    `token_minted_by_id`: the person who minted the agent token that asks (the API
    passes Principal.token_minted_by_id), recorded on the run for good: separation of
    duties keeps them out of its approvals even once that token is revoked or expired.

    Takes the per-kind advisory locks, refuses overlaps with other active runs
    (WriteSetConflict, naming every overlap), then either activates the run at
    once (every entry covered by an enabled AutoApproveRule: ownership records,
    audit `run.auto_approved`) or leaves it pending with a run approval.
    Raises ValidationFailed for a bad write set or TTL. `on_created(run, token)` runs
    inside the creating transaction (the API keeps its answer under an Idempotency-Key
    there: if that fails, no run was created).
    """
    entries = write_set_parse(write_set)
    ttl = DEFAULT_TTL_SECONDS if ttl_seconds is None else int(ttl_seconds)
    if ttl < MIN_TTL_SECONDS or ttl > _max_ttl():
        raise ValidationFailed(
            f"ttl_seconds must be between {MIN_TTL_SECONDS} and {_max_ttl()}.",
            extra={
                "errors": [
                    {
                        "field": "ttl_seconds",
                        "message": f"must be between {MIN_TTL_SECONDS} and {_max_ttl()}",
                    }
                ]
            },
        )
    new_token = token_generate(RUN_PREFIX)
    with transaction.atomic():
        lock_kinds({entry.kind for entry in entries})
        now = timezone.now()
        raise_on_overlap(entries, now=now)
        auto = auto_approved(agent, entries)
        if auto:
            raise_on_lease_blockers(entries, exclude_run_id=None)
        run = Run.objects.create(
            agent=agent,
            task=task,
            write_set=[entry.as_json() for entry in entries],
            status=RunStatus.ACTIVE if auto else RunStatus.PENDING_APPROVAL,
            token_prefix=new_token.prefix,
            token_hash=new_token.hash,
            ttl_seconds=ttl,
            expires_at=now + timedelta(seconds=ttl),
            max_expires_at=now + timedelta(seconds=_max_ttl()),
            auto_approved=auto,
            activated_at=now if auto else None,
            token_minted_by_id=token_minted_by_id,
        )
        audit_append(
            event_type="run.created",
            actor=actor,
            run_id=run.id,
            details={"task": task[:500], "write_set": run.write_set, "ttl_seconds": ttl},
        )
        if auto:
            ownership_records_create(run, entries)
            audit_append(
                event_type="run.auto_approved",
                actor=Actor.system("auto-approve"),
                run_id=run.id,
                details={"write_set": run.write_set},
            )
        else:
            approval_open_for_run(run=run)
        if on_created is not None:
            on_created(run, new_token.secret)
    return run, new_token.secret


def run_activate(*, run: Run, actor: Actor) -> Run:
    """Make a pending run active (called when its approval reaches quorum).

    Re-checks overlaps under the per-kind locks (another run may have become
    active since this one was requested): raises WriteSetConflict and leaves
    the run pending. Raises InvalidTransition unless the run is pending.
    """
    entries = entries_of(run)
    with transaction.atomic():
        lock_kinds({entry.kind for entry in entries})
        now = timezone.now()
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status != RunStatus.PENDING_APPROVAL:
            raise InvalidTransition(f"Run {run.pk} is {locked.status}, not pending approval.")
        raise_on_overlap(entries, exclude_run_id=run.pk, now=now)
        raise_on_lease_blockers(entries, exclude_run_id=run.pk)
        max_expires = now + timedelta(seconds=_max_ttl())
        expires = min(now + timedelta(seconds=locked.ttl_seconds), max_expires)
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.ACTIVE,
            activated_at=now,
            expires_at=expires,
            max_expires_at=max_expires,
        )
        locked.refresh_from_db()
        transaction.on_commit(partial(notify_run_changed, run.pk))
        ownership_records_create(locked, entries)
        audit_append(
            event_type="run.activated",
            actor=actor,
            run_id=run.pk,
            details={"write_set": locked.write_set},
        )
    run.refresh_from_db()
    return run


def run_heartbeat(*, run: Run, actor: Actor) -> Run:
    """Extend an active run's expiry by its TTL, never past `max_expires_at`."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        now = timezone.now()
        if locked.status != RunStatus.ACTIVE or locked.expires_at <= now:
            raise RunNotActive(f"Run {run.pk} is {_effective_status(locked, now)}.")
        expires = min(now + timedelta(seconds=locked.ttl_seconds), locked.max_expires_at)
        if expires > locked.expires_at:
            Run.objects.filter(pk=run.pk).update(expires_at=expires, last_heartbeat_at=now)
            OwnershipRecord.objects.filter(run_id=run.pk, active=True).update(expires_at=expires)
        else:
            Run.objects.filter(pk=run.pk).update(last_heartbeat_at=now)
        transaction.on_commit(partial(notify_run_changed, run.pk))  # its expiry moved
    run.refresh_from_db()
    return run


def _effective(status: str, expires_at: datetime | None, now: datetime) -> str:
    """An active run past `expires_at` is expired, before the sweep says so."""
    if status == RunStatus.ACTIVE and expires_at is not None and expires_at <= now:
        return RunStatus.EXPIRED
    return status


def _effective_status(run: Run, now: datetime) -> str:
    return _effective(str(run.status), run.expires_at, now)


def run_effective_status(run: Run) -> str:
    return _effective_status(run, timezone.now())


def run_status_for_share(run_id: Any) -> str:
    """The run row FOR SHARE (caller's transaction, after the per-kind and per-resource
    locks of the one lock order) and its effective status: a revoke, finish or expiry
    either committed before (seen here) or waits for the caller to commit.
    Raises RunNotActive when the run no longer exists."""
    state = lock_run_for_share(run_id)
    if state is None:
        raise RunNotActive(f"Run {run_id} no longer exists.", extra={"run": str(run_id)})
    status, expires_at = state
    return _effective(status, expires_at, timezone.now())


def run_require_own_active(*, actor: Actor, run_id: Any) -> None:
    """A run's token changes only its own run's actions (NotFound for another run's:
    it may not learn they exist), and only while that run is active (RunNotActive:
    the token still names the run). Any other actor passes: the verb's own rules apply.

    A plain read, no lock: a verb that must not race a revoke re-checks under the
    run row's FOR SHARE (undo), or is harmless if it does (a cancel of an action the
    revoke cancels anyway).
    """
    if actor.type != ActorType.RUN:
        return
    if actor.id != str(run_id):
        raise NotFound("No such action.")
    run = Run.objects.filter(pk=run_id).first()
    status = run_effective_status(run) if run is not None else "deleted"
    if status != RunStatus.ACTIVE:
        raise RunNotActive(
            f"Run {run_id} is {status}; only active runs write.",
            extra={"run": str(run_id), "run_status": status},
        )


def _end(
    run_id: Any,
    *,
    status: str,
    from_statuses: tuple[str, ...],
    actor: Actor,
    event: str,
    reason: str,
    action_status: str,
) -> bool:
    now = timezone.now()
    changed = Run.objects.filter(pk=run_id, status__in=from_statuses).update(
        status=status, ended_at=now, status_reason=reason[:1000]
    )
    if not changed:
        return False
    transaction.on_commit(partial(notify_run_changed, run_id))
    OwnershipRecord.objects.filter(run_id=run_id, active=True).update(active=False, released_at=now)
    ended_plans = _end_plans(run_id, status=status)
    # The project's lock order: run -> plans -> actions -> approvals -> audit head last
    # (approval_decide and action_cancel take the action before its approval).
    # A person's conflict resolution, and an external write that may already have
    # reached its target, outlive the run (run_end_exempt): they settle later.
    open_ids = list(
        Action.objects.filter(run_id=run_id, status__in=OPEN_ACTION_STATUSES)
        .exclude(run_end_exempt())
        .values_list("id", flat=True)
    )
    if open_ids:
        Action.objects.filter(id__in=open_ids, status__in=OPEN_ACTION_STATUSES).update(
            status=action_status,
            revision=F("revision") + 1,
            updated_at=now,
            error={"code": "run_not_active", "detail": f"the run was {status}"},
        )
        for action_id in open_ids:
            transaction.on_commit(partial(notify_action_changed, action_id))
    Approval.objects.filter(
        run_id=run_id, status=ApprovalStatus.PENDING, from_conflict__isnull=True
    ).update(status=ApprovalStatus.CANCELLED, decided_at=now)
    audit_append(
        event_type=event,
        actor=actor,
        run_id=run_id,
        details={
            "reason": reason[:500],
            "closed_actions": [str(a) for a in open_ids],
            **({"cancelled_plans": ended_plans} if ended_plans else {}),
        },
    )
    return True


def _end_plans(run_id: Any, *, status: str) -> list[str]:
    """A run's end: a plan still waiting for its approval is cancelled (nothing ran, its
    approval is cancelled with the others); a plan on its way compensates — its
    current step's write is closed with the run's other open actions — so it is moved
    now rather than at the reconciler's next pass. Returns the cancelled plans."""
    cancelled = plans_end_unapproved(
        run_id=run_id,
        status=PlanStatus.CANCELLED,
        error={"code": "run_not_active", "detail": f"the run was {status}"},
    )
    for plan_id in Plan.objects.filter(run_id=run_id, status=PlanStatus.EXECUTING).values_list(
        "pk", flat=True
    ):
        transaction.on_commit(partial(enqueue_plan_advance, plan_id))
    return [str(plan_id) for plan_id in cancelled]


def run_finish(*, run: Run, actor: Actor) -> Run:
    """End a run and free its ownership records. Actions that have not started
    executing are cancelled. Finishing a finished run is a no-op (no second
    audit row); finishing a rejected/expired/revoked run is 409 run_not_active."""
    ended = _close(run, RunStatus.FINISHED, actor=actor, reason="finished by the agent")
    if not ended and run.status != RunStatus.FINISHED:
        raise RunNotActive(f"Run {run.pk} is {run.status}.")
    return run


def run_revoke(*, run: Run, actor: Actor, reason: str) -> Run:
    """Revoke a run (an operator's decision): ownership freed, open actions cancelled.

    Raises Forbidden unless the actor is a person who may decide approvals (or the
    system), InvalidTransition when the run already ended otherwise.
    """
    require_person(actor, can_decide_approvals, "Revoking a run needs the operator role.")
    ended = _close(run, RunStatus.REVOKED, actor=actor, reason=reason)
    if not ended and run.status != RunStatus.REVOKED:
        raise InvalidTransition(f"Run {run.pk} is {run.status}.")
    return run


def run_reject(*, run: Run, actor: Actor, reason: str) -> Run:
    """A pending run's approval was rejected."""
    _close(
        run,
        RunStatus.REJECTED,
        actor=actor,
        reason=reason,
        from_statuses=(RunStatus.PENDING_APPROVAL,),
    )
    return run


def _close(
    run: Run,
    status: str,
    *,
    actor: Actor,
    reason: str,
    from_statuses: tuple[str, ...] = (RunStatus.ACTIVE, RunStatus.PENDING_APPROVAL),
) -> bool:
    """End a live run as `status` (event `run.<status>`), cancelling its open actions,
    and reload it. Returns whether this call ended it."""
    with transaction.atomic():
        ended = _end(
            run.pk,
            status=status,
            from_statuses=from_statuses,
            actor=actor,
            event=f"run.{status}",
            reason=reason,
            action_status=ActionStatus.CANCELLED,
        )
    run.refresh_from_db()
    return ended


def run_expire_due(*, now: datetime | None = None) -> int:
    """Expire active runs past `expires_at` (housekeeping calls this).

    Ownership is freed and actions not yet executing become `expired`:
    expired runs write nothing.
    """
    now = now or timezone.now()
    count = 0
    # Pending runs are ended by their approval's expiry (the engine), not here.
    due = Run.objects.filter(status=RunStatus.ACTIVE, expires_at__lte=now).values_list(
        "id", flat=True
    )
    for run_id in list(due[:1000]):
        with transaction.atomic():
            if _end(
                run_id,
                status=RunStatus.EXPIRED,
                from_statuses=(RunStatus.ACTIVE,),
                actor=Actor.system("housekeeping"),
                event="run.expired",
                reason="expired",
                action_status=ActionStatus.EXPIRED,
            ):
                count += 1
    return count
