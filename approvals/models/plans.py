"""Plans: several conditional writes of one run, approved as one unit, applied in order
and compensated in reverse (approvals/services/plans.py and plan_engine.py)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from approvals.models.writes import ConditionalWrite, Revisioned


class PlanStatus(models.TextChoices):
    PENDING_APPROVAL = "pending_approval", "pending approval"
    EXECUTING = "executing", "executing"
    COMPENSATING = "compensating", "compensating"
    APPLIED = "applied", "applied"
    COMPENSATED = "compensated", "compensated"
    # Compensation blocked by conflicts a person decides; settling them finishes it.
    PARTIALLY_COMPENSATED = "partially_compensated", "partially compensated"
    REJECTED = "rejected", "rejected"
    EXPIRED = "expired", "expired"
    CANCELLED = "cancelled", "cancelled"  # its run ended before the plan was approved
    # A person approved it with one step edited: the edited plan (superseded_by) replaced
    # it, and nothing of it ran (approvals/services/plan_edits.py).
    SUPERSEDED = "superseded", "superseded"


FINAL_PLAN_STATUSES = frozenset(
    {
        PlanStatus.APPLIED,
        PlanStatus.COMPENSATED,
        PlanStatus.REJECTED,
        PlanStatus.EXPIRED,
        PlanStatus.CANCELLED,
        PlanStatus.SUPERSEDED,
    }
)


class Plan(Revisioned):
    """Several conditional writes of one run, approved as one, applied in order and
    compensated in reverse when a later step fails for good (approvals/services/plans.py).
    Its steps' states are the outbox: the reconciler resumes a plan from them."""

    ETAG_PREFIX = "p"
    FINAL_STATUSES = FINAL_PLAN_STATUSES

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    run = models.ForeignKey("approvals.Run", on_delete=models.PROTECT, related_name="plans")
    agent = models.ForeignKey("approvals.Agent", on_delete=models.PROTECT, related_name="plans")
    status = models.CharField(max_length=24, choices=PlanStatus.choices)
    reason = models.CharField(max_length=500, blank=True)
    idempotency_key = models.CharField(max_length=255, blank=True)
    # Why the plan stopped going forward: {"step", "code", "message"}.
    error = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    # Approve with edits (approvals/services/plan_edits.py), as on Action: the original,
    # `superseded`, names the edited plan that replaced it; the edited plan names the
    # person who edited it and what changed ({"by", "supersedes", "step", "diff", ...}).
    superseded_by = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="supersedes"
    )
    # As Action.edited_by: optional, and the row outlives its editor.
    edited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    edit = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["status", "updated_at"])]

    def __str__(self) -> str:
        return f"plan {self.id}"


class PlanStepStatus(models.TextChoices):
    PENDING = "pending", "pending"  # waits for the steps before it
    EXECUTING = "executing", "executing"  # its action is in the engine
    APPLIED = "applied", "applied"
    REFUSED = "refused", "refused"  # failed for good: the plan compensates
    SKIPPED = "skipped", "skipped"  # never ran: an earlier step failed


class CompensationStatus(models.TextChoices):
    NONE = "", "not needed"
    PENDING = "pending", "pending"
    COMPENSATED = "compensated", "compensated"
    CONFLICT = "conflict", "conflict: a person decides"
    RESOLVED = "resolved", "settled by a person's resolution"
    FAILED = "failed", "could not be compensated"


class PlanStep(ConditionalWrite):
    """One conditional write of a plan, recorded whole before anything executes; its
    action is created when its turn comes (so nothing runs it out of order)."""

    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, related_name="steps")
    position = models.PositiveSmallIntegerField()  # 1-based order of execution
    # Null: undo the step; else the agent's conditional write {"method", "document"|"patch"}.
    compensation = models.JSONField(null=True, blank=True)
    status = models.CharField(
        max_length=12, choices=PlanStepStatus.choices, default=PlanStepStatus.PENDING
    )
    action = models.OneToOneField(
        "approvals.Action",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="plan_step",
    )
    # The operation that applied the step (the action's, or its conflict resolution's).
    applied_operation = models.ForeignKey(
        "approvals.Operation", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    compensation_status = models.CharField(
        max_length=12, choices=CompensationStatus.choices, blank=True, default=""
    )
    compensation_operation = models.ForeignKey(
        "approvals.Operation", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    error = models.JSONField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["plan", "position"]
        constraints = [
            models.UniqueConstraint(fields=["plan", "position"], name="plan_step_position"),
            models.UniqueConstraint(fields=["plan", "kind", "name"], name="plan_step_resource"),
        ]

    def __str__(self) -> str:
        return f"step {self.position} of plan {self.plan_id}"
