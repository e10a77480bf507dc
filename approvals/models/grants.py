"""Standing grants: a person's "approve and allow similar" (docs/grants.md)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from approvals.models.choices import WriteOperation


class GrantScope(models.TextChoices):
    RUN = "run", "this run"
    AGENT = "agent", "the agent, across runs"


class GrantState(models.TextChoices):
    """Derived, never stored (approvals/services/grants.py `_grant_state`)."""

    LIVE = "live", "live"
    REVOKED = "revoked", "revoked"
    EXPIRED = "expired", "expired"
    SPENT = "spent", "every use spent"
    RUN_ENDED = "run_ended", "its run ended"


class Grant(models.Model):
    """Standing approval, given by the person who approved one per-call write, for more
    writes like it: same kind, same operation, a name starting with `name_prefix`.

    Bounded by `uses` and `expires_at` (both required, capped by settings), never wider
    than the granting run's write set. A run-scoped grant (`run` set) admits that run's
    writes only, so it ends with the run; an agent-scoped one (`run` null, admins only)
    admits any run of `agent`. A use is counted by one conditional UPDATE
    (approvals/services/grants.py grant_use_for_proposal), so concurrent proposals never
    take more than `uses`. Revoking stamps `revoked_at`: no use after it.
    """

    kind = models.ForeignKey("ownership.ResourceKind", on_delete=models.PROTECT, related_name="+")
    operation = models.CharField(max_length=16, choices=WriteOperation.choices)
    name_prefix = models.CharField(max_length=255, blank=True)
    scope = models.CharField(max_length=8, choices=GrantScope.choices, default=GrantScope.RUN)
    run = models.ForeignKey(
        "approvals.Run", null=True, blank=True, on_delete=models.PROTECT, related_name="grants"
    )
    agent = models.ForeignKey("approvals.Agent", on_delete=models.PROTECT, related_name="grants")
    # The person who granted it (the approver); the row outlives them.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    reason = models.CharField(max_length=2000, blank=True)
    # The approval whose decision made it (the write it was modelled on).
    approval = models.ForeignKey(
        "approvals.Approval", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    uses = models.PositiveIntegerField()
    used = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # The proposal's one statement (grant_use_for_proposal): the live grants of a
            # kind and operation. Spent and revoked grants leave it.
            models.Index(
                fields=["kind", "operation", "expires_at"],
                condition=Q(revoked_at__isnull=True, used__lt=F("uses")),
                name="grant_live",
            ),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(uses__gte=1), name="grant_uses_positive"),
            models.CheckConstraint(condition=Q(used__lte=F("uses")), name="grant_used_within"),
            models.CheckConstraint(
                condition=Q(scope="run", run__isnull=False) | Q(scope="agent", run__isnull=True),
                name="grant_scope_matches_run",
            ),
        ]

    def __str__(self) -> str:
        return f"grant {self.pk} {self.kind_id}/{self.name_prefix}* {self.operation}"

    @property
    def uses_left(self) -> int:
        return max(self.uses - self.used, 0)
