"""Agents, tokens, runs, actions, approvals, operations and idempotency records."""

from __future__ import annotations

import functools
import operator
import uuid
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import models
from django.db.models import Exists, OuterRef, Q

from approvals.models.choices import PayloadFormat, WriteOperation
from approvals.models.writes import ConditionalWrite, Revisioned

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def _accountable_person(*, related_name: str) -> models.ForeignKey[User | None, User | None]:
    """A person separation of duties treats like an agent's owner (approvals/services/
    decisions.py): optional, and the row outlives them."""
    return models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name=related_name,
    )


class Agent(models.Model):
    """A registered automated principal (e.g. `deploy-bot`)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    # The person accountable for this agent; separation of duties may forbid
    # them from approving the agent's own actions.
    owner = _accountable_person(related_name="owned_agents")
    # Who registered it: separation of duties treats them like the owner.
    created_by = _accountable_person(related_name="+")
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class TokenFields(models.Model):
    """A secret stored only as its SHA-256, found by a short readable prefix."""

    prefix = models.CharField(max_length=16, db_index=True)
    token_hash = models.CharField(max_length=64, unique=True)
    label = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True


class AgentToken(TokenFields):
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="tokens")
    # Who minted it (null for the command line): while the token is live,
    # separation of duties treats them like the agent's owner.
    created_by = _accountable_person(related_name="+")

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.agent_id})"


class PersonalToken(TokenFields):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="personal_tokens"
    )

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user_id})"


class RunStatus(models.TextChoices):
    PENDING_APPROVAL = "pending_approval", "pending approval"
    ACTIVE = "active", "active"
    REJECTED = "rejected", "rejected"
    FINISHED = "finished", "finished"
    EXPIRED = "expired", "expired"
    REVOKED = "revoked", "revoked"


class Run(models.Model):
    """One execution session of an agent, with its own short-lived run token."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="runs")
    task = models.TextField()
    # The write set as declared: [{"resource": "kind/name-or-prefix*", "operations": [...]}].
    write_set = models.JSONField(default=list)
    status = models.CharField(
        max_length=20, choices=RunStatus.choices, default=RunStatus.PENDING_APPROVAL
    )
    token_prefix = models.CharField(max_length=16, db_index=True)
    token_hash = models.CharField(max_length=64, unique=True)
    ttl_seconds = models.PositiveIntegerField(default=3600)
    expires_at = models.DateTimeField()
    # Heartbeats never extend a run past this.
    max_expires_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    auto_approved = models.BooleanField(default=False)
    status_reason = models.TextField(blank=True)
    # Who minted the agent token that created this run (null: a token made by the
    # command line, or unknown for a run older than this field). Recorded once, at
    # creation: separation of duties keeps this person out of the run's approvals
    # and its calls' even after that token is revoked or expires.
    token_minted_by = _accountable_person(related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    activated_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["status", "expires_at"])]
        constraints = [
            models.CheckConstraint(
                condition=Q(expires_at__lte=models.F("max_expires_at")),
                name="run_expiry_within_max",
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.id}"


class ActionStatus(models.TextChoices):
    PENDING_APPROVAL = "pending_approval", "pending approval"
    QUEUED = "queued", "queued"
    EXECUTING = "executing", "executing"
    APPLIED = "applied", "applied"
    CONFLICT = "conflict", "conflict"
    REJECTED = "rejected", "rejected"
    FAILED = "failed", "failed"
    EXPIRED = "expired", "expired"
    CANCELLED = "cancelled", "cancelled"
    PAUSED = "paused", "paused"
    UNDONE = "undone", "undone"
    # A person approved an edited version instead (Action.superseded_by): never executed.
    SUPERSEDED = "superseded", "superseded"


FINAL_ACTION_STATUSES = frozenset(
    {
        ActionStatus.SUPERSEDED,
        ActionStatus.APPLIED,
        ActionStatus.CONFLICT,
        ActionStatus.REJECTED,
        ActionStatus.FAILED,
        ActionStatus.EXPIRED,
        ActionStatus.CANCELLED,
        ActionStatus.UNDONE,
    }
)
# Approved writes in flight: they will run (a pending_approval one may never be approved).
# The states an execution's outcome moves a write from, and the predicate of the partial
# index action_in_flight.
IN_FLIGHT_STATUSES = (ActionStatus.QUEUED, ActionStatus.EXECUTING)


class Action(ConditionalWrite, Revisioned):
    """One proposed write by a run."""

    ETAG_PREFIX = "a"
    FINAL_STATUSES = FINAL_ACTION_STATUSES

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="actions")
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="actions")
    # Set once the resource row exists (creates get it at execution).
    resource = models.ForeignKey(
        "ownership.Resource",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="actions",
    )
    status = models.CharField(
        max_length=20, choices=ActionStatus.choices, default=ActionStatus.QUEUED
    )
    reason = models.CharField(max_length=500, blank=True)  # Airlock-Reason
    idempotency_key = models.CharField(max_length=255, blank=True)
    request_id = models.CharField(max_length=128, blank=True)
    paused_reason = models.TextField(blank=True)
    error = models.JSONField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    not_before = models.DateTimeField(null=True, blank=True)
    # A resolution creates a new action based on the current version.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="children"
    )
    # Approve with edits (approvals/services/edits.py): the original, `superseded`, names
    # the edited action that replaced it; the edited action names the person who edited
    # it and what changed between the agent's proposal and the approved write.
    superseded_by = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="supersedes"
    )
    edited_by = _accountable_person(related_name="+")
    edit = models.JSONField(null=True, blank=True)
    # A per-call write admitted by a person's standing grant instead of a decision
    # (approvals/services/grants.py); the dashboard counts these.
    grant = models.ForeignKey(
        "approvals.Grant",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        # No index on every action: the partial one below holds granted writes only.
        db_index=False,
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["status", "created_at"]),
            models.Index(fields=["run", "created_at"]),
            models.Index(fields=["kind", "name", "created_at"]),
            # The approved writes in flight on a resource, which every resource read and
            # every proposal asks for (approvals/services/queued_writes.py): only those rows,
            # however long the resource's history. Its statement names the same predicate.
            # An OR, not IN: PostgreSQL prints IN's predicate back as SQL that it parses to
            # another form, which bench/seed.py's index rebuild would flag as changed.
            models.Index(
                fields=["kind", "name", "created_at", "id"],
                condition=functools.reduce(
                    operator.or_, (Q(status=status) for status in IN_FLIGHT_STATUSES)
                ),
                name="action_in_flight",
            ),
            # Writes admitted by a standing grant, by time (the dashboard's "decisions saved").
            models.Index(
                fields=["created_at"], condition=Q(grant__isnull=False), name="action_granted"
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(operation="create") | Q(observed_version__isnull=False),
                name="action_update_delete_observe_a_version",
            ),
        ]

    def __str__(self) -> str:
        return f"action {self.id}"

    @property
    def observed_etag(self) -> str | None:
        return None if self.observed_version is None else f'"{self.observed_version}"'


class ApprovalSubject(models.TextChoices):
    RUN = "run", "run"
    ACTION = "action", "action"
    PLAN = "plan", "plan"


class ApprovalStatus(models.TextChoices):
    PENDING = "pending", "pending"
    APPROVED = "approved", "approved"
    REJECTED = "rejected", "rejected"
    EXPIRED = "expired", "expired"
    CANCELLED = "cancelled", "cancelled"


class Approval(models.Model):
    """A request for a person's decision on a run (per-run) or one action (per-call).

    A per-call approval binds the version it was shown (`observed_version`): if
    the resource moved before execution, the approval is never reused.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    subject = models.CharField(max_length=8, choices=ApprovalSubject.choices)
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="approvals")
    action = models.ForeignKey(
        Action, null=True, blank=True, on_delete=models.PROTECT, related_name="approvals"
    )
    # A plan's one approval covers all its steps (approvals/services/plans.py).
    plan = models.ForeignKey(
        "approvals.Plan", null=True, blank=True, on_delete=models.PROTECT, related_name="approvals"
    )
    status = models.CharField(
        max_length=12, choices=ApprovalStatus.choices, default=ApprovalStatus.PENDING
    )
    quorum = models.PositiveSmallIntegerField(default=1)
    observed_version = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001 (None: no version)
    expires_at = models.DateTimeField()
    escalate_at = models.DateTimeField(null=True, blank=True)
    escalated_at = models.DateTimeField(null=True, blank=True)
    # A conflict resolution is itself the approval of the action it creates.
    from_conflict = models.ForeignKey(
        "ownership.Conflict", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]
        indexes = [
            models.Index(fields=["status", "created_at"]),
            # A run's own approval, newest first: every action poll's body names it (the
            # run's per-call approvals would otherwise be read one by one, as many as the
            # run has proposed).
            models.Index(
                fields=["run", "-created_at"], condition=Q(subject="run"), name="approval_of_run"
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(subject="run", action__isnull=True, plan__isnull=True)
                | Q(subject="action", action__isnull=False, plan__isnull=True)
                | Q(subject="plan", action__isnull=True, plan__isnull=False),
                name="approval_subject_matches_target",
            ),
            models.UniqueConstraint(
                fields=["action"],
                condition=Q(status="pending"),
                name="approval_one_pending_per_action",
            ),
            models.UniqueConstraint(
                fields=["plan"],
                condition=Q(status="pending"),
                name="approval_one_pending_per_plan",
            ),
            models.CheckConstraint(condition=Q(quorum__gte=1), name="approval_quorum_positive"),
        ]

    def __str__(self) -> str:
        return f"approval {self.id} ({self.subject})"


class Decision(models.TextChoices):
    APPROVE = "approve", "approve"
    REJECT = "reject", "reject"


class ApprovalDecision(models.Model):
    """One person's decision; a person counts once per approval."""

    approval = models.ForeignKey(Approval, on_delete=models.PROTECT, related_name="decisions")
    person = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    decision = models.CharField(max_length=8, choices=Decision.choices)
    comment = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["approval", "person"], name="approvaldecision_one_per_person"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.decision} by {self.person_id}"


class AutoApproveRule(models.Model):
    """Data, editable by admins: run write-set entries this rule covers are admitted
    without a person (e.g. a sandbox namespace). A run is auto-approved only when
    every entry of its write set is covered and none of its per-run classes needs
    a quorum above one."""

    kind = models.ForeignKey("ownership.ResourceKind", on_delete=models.CASCADE, related_name="+")
    name_prefix = models.CharField(max_length=255, blank=True)
    operations = models.JSONField(default=list)
    agent = models.ForeignKey(Agent, null=True, blank=True, on_delete=models.CASCADE)
    enabled = models.BooleanField(default=True)
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"auto-approve {self.kind_id}/{self.name_prefix}*"


class OperationStatus(models.TextChoices):
    PENDING = "pending", "pending"
    DONE = "done", "done"
    FAILED = "failed", "failed"
    UNKNOWN = "unknown", "unknown"
    UNDONE = "undone", "undone"


class Operation(models.Model):
    """The execution record of an action (or of an undo of one).

    `lease_expires_at` lets the reconciler find an operation left pending by a
    dead worker. At most one live undo per operation (pending or done: a partial
    unique constraint); an undo that failed for a retryable reason may be asked
    for again, as a new undo operation.
    """

    action = models.ForeignKey(Action, on_delete=models.PROTECT, related_name="operations")
    undo_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="undone_by"
    )
    fence = models.BigIntegerField()
    status = models.CharField(
        max_length=12, choices=OperationStatus.choices, default=OperationStatus.PENDING
    )
    # Versions as the target's tokens (text, compared exactly; the managed store's "41").
    base_version = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001 (None: no version)
    result_version = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001 (None: no version)
    undo_deadline = models.DateTimeField(null=True, blank=True)
    outcome = models.JSONField(null=True, blank=True)
    worker = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # An undo: when it was accepted (202). Its window is judged at this time, not
    # when a worker gets to it.
    accepted_at = models.DateTimeField(null=True, blank=True)
    # An undo held by a kill switch (it stays `pending`; a release resumes it).
    paused_reason = models.TextField(blank=True)
    # A plan's compensation: an undo the plan asked for, not bound by the undo window,
    # restoring `restore` ({"document", "deleted"}: the agent's explicit compensation)
    # instead of the version before the write when set.
    compensation = models.BooleanField(default=False)
    restore = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["status", "lease_expires_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["undo_of"],
                condition=Q(undo_of__isnull=False) & ~Q(status="failed"),
                name="operation_one_live_undo",
            ),
            models.UniqueConstraint(
                fields=["action"],
                condition=Q(status="done", undo_of__isnull=True),
                name="operation_one_done_per_action",
            ),
            models.CheckConstraint(condition=Q(fence__gt=0), name="operation_fence_positive"),
        ]

    def __str__(self) -> str:
        return f"operation {self.pk} (fence {self.fence})"


def unsettled_attempt() -> Q:
    """A write's attempt that may have reached its target and is not settled yet, as a
    filter on Operation: its answer was lost (`unknown`), or its worker died holding it
    (abandoned by the reconciler — killed after the target applied, the write is there and
    nothing recorded it). Only a read of the target (or a replay of its Idempotency-Key)
    tells what it did (approvals/services/external_writes.py)."""
    return Q(undo_of__isnull=True) & (
        Q(status=OperationStatus.UNKNOWN) | Q(outcome__abandoned=True)
    )


def maybe_reached_target() -> Q:
    """Writes to an external target with an unsettled attempt (`unsettled_attempt`), as a
    filter on Action."""
    maybe_sent = Operation.objects.filter(unsettled_attempt(), action=OuterRef("pk"))
    return ~Q(kind__target="managed") & Q(Exists(maybe_sent))


def run_end_exempt() -> Q:
    """Actions a run's end (finish, expiry, revoke, rejection) and its token may not
    stop, as a filter on Action:

    - a conflict resolution (`parent` set): a person's decision, not the agent's;
    - a write to an external target that may already have reached it
      (`maybe_reached_target`): only its next attempt settles what happened — a replay
      with the same target Idempotency-Key where the target honours one, else a read of
      the target (approvals/services/external_writes.py; found not applied, it is not sent
      again once the run has ended).
    """
    return Q(parent__isnull=False) | maybe_reached_target()


class IdempotencyStatus(models.TextChoices):
    IN_FLIGHT = "in_flight", "in flight"
    DONE = "done", "done"


class IdempotencyRecord(models.Model):
    """One per agent + key (writes, a run token's undo) or person + key (a
    personal token's undo): the fingerprint and the stored response to replay."""

    agent = models.ForeignKey(
        Agent, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    person = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=1024)
    status = models.CharField(
        max_length=12, choices=IdempotencyStatus.choices, default=IdempotencyStatus.IN_FLIGHT
    )
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_headers = models.JSONField(default=dict, blank=True)
    response_body = models.BinaryField(null=True, blank=True)
    action = models.ForeignKey(Action, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["agent", "key"], name="idempotency_one_per_agent_key"),
            models.UniqueConstraint(
                fields=["person", "key"], name="idempotency_one_per_person_key"
            ),
            models.CheckConstraint(
                condition=Q(agent__isnull=False, person__isnull=True)
                | Q(agent__isnull=True, person__isnull=False),
                name="idempotency_scoped_to_agent_or_person",
            ),
        ]

    def __str__(self) -> str:
        return f"idempotency {self.key}"


# The plan models live in their own module; imported here so Django registers them
# with the app (approvals.models is the module it loads).
from approvals.models.claims import Claim, ClaimSubject  # noqa: E402
from approvals.models.grants import Grant, GrantScope, GrantState  # noqa: E402
from approvals.models.plans import (  # noqa: E402
    FINAL_PLAN_STATUSES,
    CompensationStatus,
    Plan,
    PlanStatus,
    PlanStep,
    PlanStepStatus,
)

__all__ = [
    "FINAL_PLAN_STATUSES",
    "Claim",
    "ClaimSubject",
    "CompensationStatus",
    "Grant",
    "GrantScope",
    "GrantState",
    "PayloadFormat",
    "Plan",
    "PlanStatus",
    "PlanStep",
    "PlanStepStatus",
    "WriteOperation",
]
