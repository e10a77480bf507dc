"""Request and response schemas of the runs, actions, approvals and auto-approve
rules API (the OpenAPI document is generated from these)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from django.conf import settings
from ninja import Field, Schema
from pydantic import ConfigDict

from approvals.services import runs as run_services
from console.api_support import TEXT_PATTERN, JsonInt

RESOURCE_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}/([A-Za-z0-9][A-Za-z0-9._:@+=,-]{0,254}\*?|\*)$"
RULE_KIND_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"


class WriteSetEntryIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    resource: str = Field(
        ...,
        description="`kind/name`, or `kind/prefix*` for every name starting with prefix",
        pattern=RESOURCE_PATTERN,
        examples=["notification-policy/prod-alerts"],
    )
    operations: list[Literal["create", "update", "delete"]] = Field(..., min_length=1)
    lease: bool = Field(
        False,
        description="Hold an exclusive, fenced lease on these resources while the run is "
        "active: other runs' writes to them answer 423 `leased`. Overlapping leases of two "
        "runs, or a lease over another run's write still in flight, are a 409 "
        "`write_set_conflict`.",
    )


class RunCreateIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    task: str = Field(..., min_length=1, max_length=2000, pattern=TEXT_PATTERN)
    write_set: list[WriteSetEntryIn] = Field(..., min_length=1, max_length=100)
    ttl_seconds: JsonInt | None = Field(
        None, ge=run_services.MIN_TTL_SECONDS, le=settings.AIRLOCK_RUN_MAX_TTL_SECONDS
    )


class WriteSetEntryOut(Schema):
    resource: str
    operations: list[str]
    lease: bool = Field(False, description="Present (true) when the entry asked for a lease")


class RunOut(Schema):
    id: uuid.UUID
    status: Literal["pending_approval", "active", "rejected", "finished", "expired", "revoked"]
    agent: str
    task: str
    write_set: list[WriteSetEntryOut]
    ttl_seconds: int
    expires_at: datetime
    max_expires_at: datetime
    auto_approved: bool
    status_reason: str
    created_at: datetime
    activated_at: datetime | None
    ended_at: datetime | None
    url: str


class RunCreatedOut(RunOut):
    token: str = Field(..., description="The run token (rt_…); shown once")


class RunPage(Schema):
    items: list[RunOut]
    next: str | None


class ApprovalInfo(Schema):
    mode: Literal["per_run", "per_call"]
    decision: Literal["pending", "approved", "rejected", "expired", "cancelled"]
    by: str | None
    at: datetime | None
    approval_id: uuid.UUID | None = None
    approvals_so_far: int = 0
    quorum: int = 1


class ExecutionInfo(Schema):
    fence: int
    status: str
    result_etag: str | None
    finished_at: datetime | None
    undo_deadline: datetime | None


class ConflictInfo(Schema):
    model_config = ConfigDict(extra="allow")

    conflict_id: uuid.UUID
    resource: str
    expected_etag: str | None
    current_etag: str | None
    conflict_class: str
    resolver: str
    retryable_by_agent: bool
    status: str


class UndoInfo(Schema):
    model_config = ConfigDict(extra="allow")

    status: str
    conflict_id: str | None = None


class SupersededBy(Schema):
    id: uuid.UUID
    url: str


class EditInfo(Schema):
    model_config = ConfigDict(extra="allow")

    by: str | None
    supersedes: uuid.UUID | None
    comment: str
    diff: list[dict[str, Any]]


class ActionOut(Schema):
    id: uuid.UUID
    run: uuid.UUID
    agent: str
    resource: str
    operation: Literal["create", "update", "delete"]
    status: Literal[
        "pending_approval",
        "queued",
        "executing",
        "applied",
        "conflict",
        "rejected",
        "failed",
        "expired",
        "cancelled",
        "paused",
        "undone",
        "superseded",
    ]
    etag: str
    observed_etag: str | None
    conflict_class: str
    reason: str
    paused_reason: str
    approval: ApprovalInfo | None
    execution: ExecutionInfo | None
    conflict: ConflictInfo | None
    resolution: str | None
    resolution_action: uuid.UUID | None
    parent: uuid.UUID | None
    superseded_by: SupersededBy | None = Field(
        None,
        description="A `superseded` action: the edited action a person approved instead "
        "(follow it for the outcome)",
    )
    edited: EditInfo | None = Field(
        None,
        description="An action a person edited before approving: who, the action it "
        "replaced, and the diff from the agent's proposal to the approved write",
    )
    undo: UndoInfo | None
    error: dict[str, Any] | None
    url: str
    created_at: datetime
    updated_at: datetime


class ActionPage(Schema):
    items: list[ActionOut]
    next: str | None


class DiffRow(Schema):
    path: str
    current: Any = None
    proposed: Any = None


class ApprovalItem(Schema):
    id: uuid.UUID
    subject: Literal["run", "action", "plan"]
    run: uuid.UUID
    action: uuid.UUID | None
    plan: uuid.UUID | None = Field(None, description="A plan approval: the plan it admits")
    steps: list[dict[str, Any]] | None = Field(
        None,
        description="A plan approval: every step (resource, operation, class, diff against "
        "the resource now, compensation method; its `document` or `patch` and "
        "`observed_diff` against the version observed; `compensation_write`: the "
        "compensation's method, document or patch, operation, class, `deletes` and `diff` "
        "against the version observed); `quorum` is the strictest class's, compensations' "
        "classes included",
    )
    agent: str
    task: str
    write_set: list[WriteSetEntryOut] | None
    resource: str | None
    operation: str | None
    conflict_class: str | None
    diff: list[DiffRow] | None
    observed_etag: str | None
    current_etag: str | None
    approvals_so_far: int
    quorum: int
    expires_at: datetime
    status: Literal["pending", "approved", "rejected", "expired", "cancelled"]
    created_at: datetime


class ApprovalPage(Schema):
    items: list[ApprovalItem]
    next: str | None


class GrantIn(Schema):
    """ "Approve and allow similar" (docs/grants.md): with an approval, standing approval
    for writes of the same kind and operation whose names start with `name_prefix`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    uses: JsonInt = Field(
        ..., ge=1, description="How many writes it admits (at most AIRLOCK_GRANT_MAX_USES)."
    )
    ttl_seconds: JsonInt = Field(
        ..., ge=60, description="How long it lives (at most AIRLOCK_GRANT_MAX_TTL_SECONDS)."
    )
    name_prefix: str = Field(
        ...,
        max_length=255,
        pattern=r"^[^\x00-\x1f\x7f]*$",
        description="A prefix of the approved write's name, covered by one prefix entry of the "
        "run's write set for this operation (403 not_in_write_set otherwise).",
    )
    scope: Literal["run", "agent"] = Field(
        "run",
        description="`run`: this run's writes only, ending with it; `agent`: any run of the "
        "agent (admins only).",
    )
    reason: str = Field("", max_length=2000, pattern=TEXT_PATTERN)


class GrantOut(Schema):
    id: int
    kind: str
    operation: Literal["create", "update", "delete"]
    name_prefix: str
    scope: Literal["run", "agent"]
    run: uuid.UUID | None
    agent: str
    owner: str | None
    reason: str
    approval: uuid.UUID | None
    uses: int
    used: int
    uses_left: int
    created_at: datetime
    expires_at: datetime
    seconds_left: int
    revoked_at: datetime | None
    revoked_by: str | None
    state: Literal["live", "revoked", "expired", "spent", "run_ended"]


class GrantPage(Schema):
    items: list[GrantOut]
    next: str | None


class DecisionIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    decision: Literal["approve", "reject", "approve_with_edits"]
    comment: str = Field("", max_length=2000, pattern=TEXT_PATTERN)
    document: dict[str, Any] | None = Field(
        None,
        description="approve_with_edits: the write as approved, in place of the proposed "
        "document (for a PATCH proposal, the merge patch)",
    )
    patch: dict[str, Any] | None = Field(
        None,
        description="approve_with_edits: a JSON merge patch (RFC 7396) applied to the "
        "proposed document; send `document` or `patch`, not both",
    )
    step: int | None = Field(
        None,
        ge=1,
        le=32767,
        description="approve_with_edits on a plan's approval: the position (from 1) of the "
        "step whose `document` or `patch` this is; the edited plan replaces the proposed one "
        "(docs/plans.md). Not with a single write's approval",
    )
    grant: GrantIn | None = Field(
        None,
        description="approve only, on a per-call approval with a quorum of one whose class "
        "allows grants: also grant standing approval for similar writes (docs/grants.md)",
    )


class RevokeIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    reason: str = Field(..., min_length=1, max_length=1000, pattern=r"^[^\x00]*\S[^\x00]*$")


class AutoApproveRuleIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    kind: str = Field(..., pattern=RULE_KIND_PATTERN, description="A resource kind slug")
    name_prefix: str = Field(
        "",
        max_length=255,
        pattern=TEXT_PATTERN,
        description="Covers write-set entries whose name (or name prefix) starts with this; "
        "empty covers every name of the kind",
    )
    operations: list[Literal["create", "update", "delete"]] = Field(..., min_length=1, max_length=3)
    agent: str | None = Field(
        None,
        min_length=1,
        max_length=150,
        pattern=TEXT_PATTERN,
        description="Only this agent's runs (by name); null: any agent",
    )
    enabled: bool = True
    description: str = Field("", max_length=200, pattern=TEXT_PATTERN)


class AutoApproveRuleOut(Schema):
    id: int
    kind: str
    name_prefix: str
    operations: list[str]
    agent: str | None
    enabled: bool
    description: str


class AutoApproveRulePage(Schema):
    items: list[AutoApproveRuleOut]
    next: str | None
