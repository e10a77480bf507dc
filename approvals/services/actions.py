"""Proposing, reading and cancelling actions (one proposed write by a run).

The API checks, in this order: authentication -> run active -> write set ->
key format -> idempotency -> precondition -> record. `action_check_writable`
is the run/write-set part, `action_propose` the precondition and record part;
the idempotency layer sits between them in the API handler because it stores
HTTP responses.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from approvals.models import (
    Action,
    ActionStatus,
    Approval,
    ApprovalStatus,
    PayloadFormat,
    Run,
    RunStatus,
)
from approvals.notify import notify_action_changed
from approvals.outbox import enqueue_action_execution
from approvals.services.approval_open import approval_open_for_action
from approvals.services.grants import grant_use_for_proposal, grants_may_admit
from approvals.services.preconditions import PreconditionRequired, TagCondition
from approvals.services.queued_writes import (
    QueuedWrite,
    lock_resource_for_proposal,
    superseding_write,
    try_lock_resource_for_proposal,
    writes_in_flight,
)
from approvals.services.runs import (
    RunNotActive,
    run_effective_status,
    run_require_own_active,
    run_status_for_share,
)
from approvals.services.write_sets import lock_kind_for_proposal, names_overlap
from audit.models import ActorType
from audit.services import Actor, audit_append, audit_deferred
from console.compiled_query import CompiledInsert, CompiledQuery, Param
from console.permissions import can_decide_approvals, require_person
from console.requestctx import current_request_id
from console.tracing import traced_propose
from engine.core.action_audit import audit_action_event
from engine.core.errors import (
    DomainError,
    Forbidden,
    InvalidTransition,
    NotFound,
    ValidationFailed,
)
from engine.core.killswitch import engaged_switch_for
from ownership.models import ConflictClass, OwnershipRecord, Resource, ResourceKind
from ownership.reopen import conflict_reopen_for_resolution

logger = logging.getLogger("airlock.actions")

CANCELLABLE = (ActionStatus.PENDING_APPROVAL, ActionStatus.QUEUED, ActionStatus.PAUSED)


class Leased(DomainError):
    code = "leased"
    retryable = True


# --- Checks before the idempotency layer ---------------------------------


def _authority_query() -> QuerySet[OwnershipRecord]:
    now = Param("now", OwnershipRecord._meta.get_field("expires_at"))
    run_id = Param("run_id", Run._meta.get_field("id"))
    return (
        OwnershipRecord.objects.filter(
            kind_id=Param("kind", ResourceKind._meta.get_field("slug")),
            active=True,
            expires_at__gt=now,
        )
        .filter(
            Q(run_id=run_id)
            | Q(exclusive=True, run__status=RunStatus.ACTIVE, run__expires_at__gt=now)
        )
        .order_by("created_at", "id")
    )


# Built and compiled once a process: building it was most of the check's CPU (issue 41).
_AUTHORITY_RECORDS = CompiledQuery(_authority_query)


def _authority_records(
    run_id: Any, kind: str
) -> tuple[list[OwnershipRecord], list[OwnershipRecord]]:
    """Over `kind`, in ONE statement: the run's own active, unexpired records, and the
    active, unexpired exclusive leases of other active, unexpired runs, oldest first.
    (It was two statements, and a proposal checks twice: before its key is claimed and
    under its locks. Those four were a quarter of a proposal's CPU, most of it the ORM
    compiling them; now one statement compiled once.)"""
    own: list[OwnershipRecord] = []
    leases: list[OwnershipRecord] = []
    for record in _AUTHORITY_RECORDS.all(run_id=run_id, kind=kind, now=timezone.now()):
        (own if record.run_id == run_id else leases).append(record)
    return own, leases


def _covers(record: OwnershipRecord, name: str) -> bool:
    return names_overlap(record.name, record.is_prefix, name, False)


def _check_authority(run: Run, status: str, kind: str, name: str, operation: str) -> None:
    """Run active -> write set covers -> no other run's lease. Raises 409 / 403 / 423."""
    if status != RunStatus.ACTIVE:
        raise RunNotActive(
            f"Run {run.pk} is {status}; only active runs write.",
            extra={"run": str(run.pk), "run_status": status},
        )
    own, leases = _authority_records(run.pk, kind)
    if not any(_covers(record, name) and operation in (record.operations or []) for record in own):
        raise Forbidden(
            f"The run's write set does not cover {operation} on {kind}/{name}.",
            code="not_in_write_set",
            extra={"resource": f"{kind}/{name}", "operation": operation},
        )
    lease = next((lease for lease in leases if _covers(lease, name)), None)
    if lease is not None:
        raise Leased(
            f"Run {lease.run_id} holds an exclusive lease on {lease.pattern}.",
            extra={"lease": {"run": str(lease.run_id), "expires_at": lease.expires_at.isoformat()}},
        )


def authority_check_locked(*, run: Run, status: str, kind: str, name: str, operation: str) -> None:
    """The run/write-set/lease check for a caller that already holds the kind and
    resource locks and the run FOR SHARE (a plan's proposal checks all its steps)."""
    _check_authority(run, status, kind, name, operation)


_KIND_WITH_CLASSES = CompiledQuery(
    lambda: ResourceKind.objects.filter(
        slug=Param("slug", ResourceKind._meta.get_field("slug"))
    ).select_related("class_create", "class_update", "class_delete")
)


def action_check_writable(*, run: Run, kind: str, name: str, operation: str) -> ResourceKind:
    """Run active, kind exists, the run's ownership covers (kind/name, operation),
    and no other run holds an exclusive lease over it.

    Raises RunNotActive (409), ValidationFailed (422, unknown kind),
    Forbidden code=not_in_write_set (403), Leased (423). This is the early
    answer (the contract's check order); `action_propose` checks again with the
    run row locked, so a revoke that commits in between still wins.
    """
    status = run_effective_status(run)
    if status != RunStatus.ACTIVE:
        _check_authority(run, status, kind, name, operation)
    resource_kind: ResourceKind | None = _KIND_WITH_CLASSES.first(slug=kind)
    if resource_kind is None:
        raise ValidationFailed(
            f"Resource kind {kind!r} does not exist.",
            extra={"errors": [{"field": "kind", "message": f"unknown resource kind {kind!r}"}]},
        )
    _check_authority(run, status, kind, name, operation)
    return resource_kind


# --- Proposal -------------------------------------------------------------


# A write as a row records it, in the column names a PlanStep and an Action share: what
# the agent proposed, the version its precondition matched, and its conflict class.
PROPOSED_COLUMNS = ("kind", "name", "operation", "payload_format", "payload")
WRITE_COLUMNS = (*PROPOSED_COLUMNS, "observed_version", "conflict_class")


@dataclass(frozen=True)
class Proposal:
    kind: ResourceKind
    name: str
    operation: str  # create | update | delete
    payload_format: str
    payload: Any
    if_match: TagCondition | None
    create_if_absent: bool  # If-None-Match: *
    idempotency_key: str
    reason: str

    @property
    def resource_identifier(self) -> str:
        """kind/name, as an Action's `resource_identifier` and the audit name it."""
        return f"{self.kind.slug}/{self.name}"

    def columns(
        self, *, observed_version: str | None, conflict_class: ConflictClass
    ) -> dict[str, Any]:
        """The write as a row records it (an Action, or a plan's PlanStep)."""
        return {
            **{column: getattr(self, column) for column in PROPOSED_COLUMNS},
            "observed_version": observed_version,
            "conflict_class": conflict_class,
        }


def _stale_extra(
    *, resource: str, expected: str | None, current: str | None, conflict_class: ConflictClass
) -> dict[str, Any]:
    return {
        "resource": resource,
        "expected_etag": expected,
        "current_etag": current,
        "conflict_class": conflict_class.slug,
        "resolver": conflict_class.resolver,
        "retryable_by_agent": conflict_class.retryable_by_agent,
    }


def _enqueue(action_id: uuid.UUID) -> None:
    # PostgreSQL is the outbox: if enqueueing fails, the reconciler re-enqueues
    # queued actions, so a Redis hiccup never loses the write.
    try:
        enqueue_action_execution(action_id)
    except Exception:
        logger.warning(
            "could not enqueue action %s; reconciler will retry", action_id, exc_info=True
        )


@traced_propose
def action_propose(
    *,
    run: Run,
    proposal: Proposal,
    on_recorded: Callable[[Action], None] | None = None,
    on_refused: Callable[[DomainError], None] | None = None,
) -> Action:
    """Check the precondition and record the action, in one transaction.

    Raises PreconditionRequired (428) when neither If-Match nor (for a create)
    If-None-Match: * was sent, NotFound when updating or deleting a resource
    that does not exist, StaleVersion-coded DomainError (412) when the tag no
    longer matches; the refused stale write is audited with the run's identity
    and `on_refused` runs inside that audit transaction. On success the action
    is `pending_approval` (per-call class: an approval is opened) or `queued`
    (enqueued after commit), and `on_recorded` runs inside the transaction.
    Re-checks run active / write set / lease with the run row locked FOR SHARE
    first (RunNotActive 409, not_in_write_set 403, Leased 423). A matching tag
    that an approved write already queued on the resource will supersede is
    refused the same way (412 with `queued_action`; approvals/services/queued_writes.py).
    """
    kind = proposal.kind
    identifier = proposal.resource_identifier
    conflict_class = kind.class_for(proposal.operation)
    if proposal.operation == "create":
        if not proposal.create_if_absent:
            raise PreconditionRequired(
                "Creating needs If-None-Match: *.", extra={"resource": identifier}
            )
    elif proposal.if_match is None:
        raise PreconditionRequired(
            "Writes need If-Match with the ETag you read (or If-None-Match: * to create).",
            extra={"resource": identifier},
        )
    # The events (proposed, and approval opened; or refused) are held back and appended
    # together as the transaction's last statement: the audit head, which every writer in
    # the system queues for, is then locked for the commit only, not also while the answer
    # is rendered and stored for replay.
    with transaction.atomic(), audit_deferred():
        # Lock order: kind (shared advisory) -> resource (advisory) -> run (FOR SHARE)
        # -> action insert -> idempotency record -> audit head.
        refused = _refused_at_once_or_locked(run, proposal, conflict_class)
        if refused is None:
            # The run FOR SHARE: a revoke, finish or expiry UPDATEs the run row, so it either
            # committed before (seen here: refused) or waits for the action to commit (and
            # then cancels it with the run's other open actions). Never a `queued` action of
            # an ended run. (The shared kind lock before it: a lease grant over this kind
            # either committed before, or waits and then refuses while this is in flight.)
            resource, observed_version, refused = _checked(
                run, run_status_for_share(run.pk), proposal, conflict_class
            )
            if refused is None:
                action = _record(run, proposal, resource, observed_version, conflict_class)
                if on_recorded is not None:
                    on_recorded(action)
                return action
        audit_append(
            event_type="action.refused_stale",
            actor=Actor.run(run),
            resource=identifier,
            run_id=run.pk,
            details={
                "operation": proposal.operation,
                "expected_etag": refused.extra["expected_etag"],
                "current_etag": refused.extra["current_etag"],
                "conflict_class": conflict_class.slug,
                "idempotency_key": proposal.idempotency_key,
                "reason": proposal.reason,
                **{k: v["id"] for k, v in refused.extra.items() if k == "queued_action"},
            },
        )
        if on_refused is not None:
            on_refused(refused)
    raise refused


_INSERT_ACTION = CompiledInsert(Action)

_RESOURCE_BY_NAME = CompiledQuery(
    lambda: Resource.objects.filter(
        kind_id=Param("kind", ResourceKind._meta.get_field("slug")),
        name=Param("name", Resource._meta.get_field("name")),
    )
)


def _checked(
    run: Run, run_status: str, proposal: Proposal, conflict_class: ConflictClass
) -> tuple[Resource | None, str | None, DomainError | None]:
    """The proposal checked against what is committed: the run's authority (raises 409 /
    403 / 423), then the resource (raises 404), its precondition and any write already queued
    over it. Returns the resource, the version the tag matched and the 412, if refused."""
    kind, name = proposal.kind, proposal.name
    _check_authority(run, run_status, kind.slug, name, proposal.operation)
    # The writes in flight before the resource: a queued write that applies in between then
    # shows as the newer version (a plain 412) instead of slipping past both reads.
    in_flight = writes_in_flight(kind.slug, name)
    resource: Resource | None = _RESOURCE_BY_NAME.first(kind=kind.slug, name=name)
    observed_version, refused = precondition_check(proposal, resource, conflict_class)
    if refused is None:
        refused = superseded_by_queued(proposal, observed_version, in_flight, conflict_class)
    return resource, observed_version, refused


def proposal_checked_locked(
    *, run: Run, proposal: Proposal, conflict_class: ConflictClass
) -> tuple[Resource | None, str | None, DomainError | None]:
    """An agent's proposal's checks for a write recorded on the agent's behalf (a person's
    edit, approvals/services/edits.py), by a caller holding the kind and resource proposal
    locks: the run FOR SHARE, then _checked (409 / 403 / 423 / 404 raised; the 412 returned)."""
    return _checked(run, run_status_for_share(run.pk), proposal, conflict_class)


def _refused_at_once_or_locked(
    run: Run, proposal: Proposal, conflict_class: ConflictClass
) -> DomainError | None:
    """Takes the kind and resource proposal locks — unless another proposal on the resource
    holds its lock and the committed rows already refuse this one (a stale tag, or a version
    a queued write will replace): then that 412, at once. On a hot resource the losers'
    refusals otherwise waited in line for the lock, one commit each, and the next winner's
    proposal behind them. A refusal read without the lock is the locked check's: versions
    only grow, and what the lock guards is the recording of a write, which this is not.
    Anything else (a proposal that may be recorded, a 409/403/423/404 to raise in the locked
    check's order) waits for the lock as before."""
    kind, name = proposal.kind, proposal.name
    lock_kind_for_proposal(kind.slug)
    if try_lock_resource_for_proposal(kind.slug, name):
        return None
    try:
        _, _, refused = _checked(run, run_effective_status(run), proposal, conflict_class)
    except DomainError:
        refused = None
    if refused is None:
        lock_resource_for_proposal(kind.slug, name)
    return refused


def precondition_check(
    proposal: Proposal, resource: Resource | None, conflict_class: ConflictClass
) -> tuple[str | None, DomainError | None]:
    """(observed version, None) when the tag matches, (None, the 412 error) when it
    does not; NotFound when updating or deleting a resource that does not exist."""
    identifier = proposal.resource_identifier
    exists = resource is not None and not resource.deleted
    current_etag = resource.etag if resource is not None and exists else None
    if proposal.operation == "create":
        if not exists:
            return None, None
        return None, DomainError(
            f"{identifier} already exists (If-None-Match: * failed).",
            code="stale_version",
            extra=_stale_extra(
                resource=identifier,
                expected=None,
                current=current_etag,
                conflict_class=conflict_class,
            ),
        )
    if not exists:
        raise NotFound(f"{identifier} does not exist.")
    assert resource is not None and proposal.if_match is not None
    if proposal.if_match.strong_match(current_etag):
        return resource.token, None
    return None, DomainError(
        f"{identifier} is at {current_etag}, not {proposal.if_match.describe()}.",
        code="stale_version",
        extra=_stale_extra(
            resource=identifier,
            expected=proposal.if_match.describe(),
            current=current_etag,
            conflict_class=conflict_class,
        ),
    )


def superseded_by_queued(
    proposal: Proposal,
    observed: str | None,
    in_flight: list[QueuedWrite],
    conflict_class: ConflictClass,
) -> DomainError | None:
    """The 412 of a matching tag that a write already queued will supersede, or None."""
    creating = proposal.operation == "create"
    queued = superseding_write(in_flight, creating=creating, observed_version=observed)
    if queued is None:
        return None
    queued_id = queued.id
    identifier = proposal.resource_identifier
    etag = None if observed is None else f'"{observed}"'
    extra = _stale_extra(
        resource=identifier, expected=etag, current=etag, conflict_class=conflict_class
    )
    extra["queued_action"] = {"id": str(queued_id), "url": f"/api/v1/actions/{queued_id}"}
    return DomainError(
        f"{identifier}: action {queued_id} is already queued to write over "
        f"{etag or 'the free name'}; wait for it, then re-read.",
        code="stale_version",
        extra=extra,
    )


def _record(
    run: Run,
    proposal: Proposal,
    resource: Resource | None,
    observed_version: str | None,
    conflict_class: ConflictClass,
) -> Action:
    """Insert the action (audited): pending approval for a per-call class (its
    approval opened), paused under an engaged kill switch, else queued (enqueued
    after commit)."""
    identifier = proposal.resource_identifier
    per_call = conflict_class.approval_mode == "per_call"
    # A person's standing grant may stand in for the per-call decision (one indexed
    # statement, asked only when the class needs one and allows grants; grants.py).
    granted = (
        grant_use_for_proposal(
            run=run,
            kind=proposal.kind.slug,
            name=proposal.name,
            operation=proposal.operation,
            now=timezone.now(),
        )
        if per_call and grants_may_admit(conflict_class)
        else None
    )
    if granted is not None:
        per_call = False
    # Under an engaged kill switch a write that needs no approval is
    # recorded `paused` (resumed in order on release), never refused.
    switch = None if per_call else engaged_switch_for(identifier)
    if per_call:
        initial_status = ActionStatus.PENDING_APPROVAL
    elif switch is not None:
        initial_status = ActionStatus.PAUSED
    else:
        initial_status = ActionStatus.QUEUED
    action = Action(
        **proposal.columns(observed_version=observed_version, conflict_class=conflict_class),
        run=run,
        agent_id=run.agent_id,
        resource=resource,
        status=initial_status,
        paused_reason=switch.reason if switch is not None else "",
        reason=proposal.reason,
        idempotency_key=proposal.idempotency_key,
        request_id=current_request_id()[:128],
        grant_id=granted.grant_id if granted is not None else None,
    )
    _INSERT_ACTION.insert(action)
    audit_action_event(
        action,
        event_type="action.proposed",
        actor=Actor.run(run),
        details={
            "operation": proposal.operation,
            "observed_etag": action.observed_etag,
            "conflict_class": conflict_class.slug,
            "approval": "grant" if granted else "per_call" if per_call else "per_run",
            "idempotency_key": proposal.idempotency_key,
            "reason": proposal.reason,
        },
    )
    if granted is not None:
        audit_action_event(
            action,
            event_type="grant.used",
            actor=Actor.system("grant"),
            details={
                "grant": granted.grant_id,
                "owner": granted.owner_id,
                "uses_left": granted.uses_left,
                "observed_etag": action.observed_etag,
            },
        )
    if per_call:
        approval_open_for_action(action=action)
    elif switch is None:
        transaction.on_commit(lambda: _enqueue(action.id))
    return action


def action_cancel(*, action: Action, actor: Actor) -> Action:
    """Cancel an action before execution starts (409 invalid_transition after; again, a
    no-op). Lock order: the action row (the conditional UPDATE), approvals, audit head.

    Who may (the rule's one copy; the API reads the action through the visibility
    selector first): a person with the operator role; the agent, its own actions; a
    run's token, its own run's while the run is active (NotFound / RunNotActive); the
    system. A conflict resolution (`parent` set) is its person's: the agent's tokens
    may not cancel it (Forbidden); a person who does reopens the conflict (audited).
    """
    _authorise_cancel(action, actor)
    with transaction.atomic():
        changed = Action.objects.filter(pk=action.pk, status__in=CANCELLABLE).update(
            status=ActionStatus.CANCELLED, revision=F("revision") + 1, updated_at=timezone.now()
        )
        if changed:
            Approval.objects.filter(action=action, status=ApprovalStatus.PENDING).update(
                status=ApprovalStatus.CANCELLED, decided_at=timezone.now()
            )
            audit_action_event(
                action,
                event_type="action.cancelled",
                actor=actor,
                details={},
            )
            if action.parent_id is not None:
                conflict_reopen_for_resolution(
                    action_id=action.pk, reason="resolution cancelled", actor=actor
                )
            transaction.on_commit(lambda: notify_action_changed(action.pk))
    action.refresh_from_db()
    if not changed and action.status != ActionStatus.CANCELLED:
        raise InvalidTransition(
            f"Action {action.pk} is {action.status}; only actions not yet executing can be "
            "cancelled.",
            extra={"action_status": action.status},
        )
    return action


def _authorise_cancel(action: Action, actor: Actor) -> None:
    if actor.type == ActorType.PERSON:
        require_person(actor, can_decide_approvals, "Cancelling needs the operator role.")
        return
    if actor.type == ActorType.AGENT and actor.id != str(action.agent_id):
        raise NotFound(f"Action {action.pk} not found.")
    run_require_own_active(actor=actor, run_id=action.run_id)
    if action.parent_id is not None and actor.type in (ActorType.RUN, ActorType.AGENT):
        raise Forbidden(
            "This action is a person's conflict resolution; the agent's tokens cannot cancel it.",
            code="forbidden",
        )


PAYLOAD_FORMATS = {
    "PUT": PayloadFormat.REPLACE,
    "PATCH": PayloadFormat.MERGE_PATCH,
    "DELETE": PayloadFormat.DELETE,
}


def write_operation(method: str, *, create: bool) -> str:
    """The operation an HTTP write names: DELETE deletes, a PUT with If-None-Match: *
    creates, any other PUT or PATCH updates (single writes and plan steps alike)."""
    if method == "DELETE":
        return "delete"
    return "create" if method == "PUT" and create else "update"
