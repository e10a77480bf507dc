"""Resources, their versions, write authority and conflicts."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q


class ApprovalMode(models.TextChoices):
    PER_RUN = "per_run", "per run"
    PER_CALL = "per_call", "per call"


class OnConflict(models.TextChoices):
    RETRY = "retry", "agent re-reads and retries"
    RECOMPUTE = "recompute", "agent re-reads, recomputes, retries"
    PRESENT_CANDIDATES = "present_candidates", "stop, present both candidates"
    REQUEST_REVIEW = "request_review", "stop, request review"
    STOP_UNLESS_LEASE = "stop_unless_lease", "stop unless an explicit lease covers it"


class ConflictClass(models.Model):
    """A row of the conflict-class table: what a kind of change needs and who settles it."""

    slug = models.SlugField(primary_key=True, max_length=64)
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    approval_mode = models.CharField(max_length=16, choices=ApprovalMode.choices)
    on_conflict = models.CharField(max_length=32, choices=OnConflict.choices)
    # "agent", "owner" (the resource's owner group) or "group:<name>".
    resolver = models.CharField(max_length=150)
    quorum = models.PositiveSmallIntegerField(default=1)
    undo_window_seconds = models.PositiveIntegerField(default=600)
    approval_ttl_seconds = models.PositiveIntegerField(default=172_800)
    # After this long pending, the escalation group is notified (0 = never).
    escalation_seconds = models.PositiveIntegerField(default=0)
    escalation_group = models.CharField(max_length=150, blank=True)
    # Separation of duties: the person recorded as the agent's owner may not approve.
    forbid_agent_owner_approval = models.BooleanField(default=True)
    # Whether a person may give a standing grant ("approve and allow similar",
    # approvals/services/grants.py) for writes of this class.
    grants_allowed = models.BooleanField(default=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(
                condition=Q(quorum__gte=1), name="conflictclass_quorum_positive"
            ),
            models.CheckConstraint(
                condition=Q(resolver="agent")
                | Q(resolver="owner")
                | Q(resolver__startswith="group:"),
                name="conflictclass_resolver_form",
            ),
        ]

    def __str__(self) -> str:
        return self.slug

    @property
    def retryable_by_agent(self) -> bool:
        return self.resolver == "agent"


class TargetType(models.TextChoices):
    MANAGED = "managed", "managed by Airlock"
    HTTP = "http", "HTTP service with ETags"
    POSTGRES = "postgres", "PostgreSQL table rows"
    GIT = "git", "git repository files"


class ResourceKind(models.Model):
    """A kind of resource: which conflict class each operation falls into."""

    slug = models.SlugField(primary_key=True, max_length=64)
    description = models.TextField(blank=True)
    class_create = models.ForeignKey(
        ConflictClass, on_delete=models.PROTECT, related_name="+", db_column="class_create"
    )
    class_update = models.ForeignKey(
        ConflictClass, on_delete=models.PROTECT, related_name="+", db_column="class_update"
    )
    class_delete = models.ForeignKey(
        ConflictClass, on_delete=models.PROTECT, related_name="+", db_column="class_delete"
    )
    owner_group = models.CharField(max_length=150)
    # When set, overrides the classes' undo windows for this kind.
    undo_window_seconds = models.PositiveIntegerField(null=True, blank=True)
    target = models.CharField(max_length=16, choices=TargetType.choices, default=TargetType.MANAGED)
    target_url = models.URLField(blank=True)
    # The target's settings (engine/targets: table and columns, repository and branch, …),
    # checked by engine.targets.registry before they are stored. Never a credential: a kind
    # names the environment variable that holds it (`credentials_env`).
    target_settings = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(
                condition=~Q(target="http") | ~Q(target_url=""),
                name="resourcekind_http_target_has_url",
            ),
        ]

    def __str__(self) -> str:
        return self.slug

    def class_for(self, operation: str) -> ConflictClass:
        return {
            "create": self.class_create,
            "update": self.class_update,
            "delete": self.class_delete,
        }[operation]


def version_token(version: int, external_version: str | None) -> str:
    """A resource's version as its target gives it: the target's own token, or Airlock's
    counter."""
    return external_version if external_version is not None else str(version)


def version_etag(version: int, external_version: str | None) -> str:
    """A resource's ETag: its version token, quoted (a strong validator)."""
    return f'"{version_token(version, external_version)}"'


class Resource(models.Model):
    """A durable `kind/name` with a JSON document and a monotonically rising version.

    `version` and `last_fence` are only ever changed by the write barrier's
    conditional UPDATE (engine.core.barrier) — or, on a kind with an external target, by
    the mirror's record of what the target answered (ownership.targets.mirror_snapshot:
    `last_fence` there is the newest lock fence a record was made under). A deleted
    resource keeps its row (a tombstone, `deleted=True`) so versions keep rising and undo
    can restore it.
    """

    kind = models.ForeignKey(ResourceKind, on_delete=models.PROTECT, related_name="resources")
    name = models.CharField(max_length=255)
    document = models.JSONField(default=dict)
    version = models.PositiveBigIntegerField(default=1)
    last_fence = models.BigIntegerField(default=0)
    # On a kind with an external target, this row mirrors the target: `version` counts the
    # mirror's own revisions and `external_version` holds the target's token (the ETag).
    external_version = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001 (None: no version)
    deleted = models.BooleanField(default=False)
    owner_group = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["kind_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["kind", "name"], name="resource_kind_name_unique"),
            models.CheckConstraint(condition=Q(version__gt=0), name="resource_version_positive"),
            models.CheckConstraint(condition=Q(last_fence__gte=0), name="resource_fence_nonneg"),
        ]

    def __str__(self) -> str:
        return self.identifier

    @property
    def identifier(self) -> str:
        return f"{self.kind_id}/{self.name}"

    @property
    def token(self) -> str:
        """The version as its target gives it: the target's own token, or the counter."""
        return version_token(self.version, self.external_version)

    @property
    def etag(self) -> str:
        return version_etag(self.version, self.external_version)


class ResourceVersion(models.Model):
    """An immutable snapshot of a resource after each accepted write."""

    resource = models.ForeignKey(Resource, on_delete=models.PROTECT, related_name="versions")
    version = models.PositiveBigIntegerField()
    # The external target's token at this revision (null on Airlock's own store).
    external_version = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001 (None: no version)
    document = models.JSONField(default=dict)
    deleted = models.BooleanField(default=False)
    operation = models.CharField(max_length=16)  # create / update / delete / undo / seed
    fence = models.BigIntegerField(default=0)
    run = models.ForeignKey(
        "approvals.Run", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    action = models.ForeignKey(
        "approvals.Action", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    person = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["resource_id", "-version"]
        constraints = [
            models.UniqueConstraint(
                fields=["resource", "version"], name="resourceversion_resource_version_unique"
            ),
            models.CheckConstraint(
                condition=Q(version__gt=0), name="resourceversion_version_positive"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.resource_id}@{self.version}"


class OwnershipRecord(models.Model):
    """ "Run R may do operations O on resource (or name prefix) X until T".

    `exclusive=True` makes it a lease with a fencing token. Released or expired
    records stay for history; `active` is cleared when they end.
    """

    run = models.ForeignKey("approvals.Run", on_delete=models.CASCADE, related_name="ownership")
    kind = models.ForeignKey(ResourceKind, on_delete=models.PROTECT, related_name="+")
    # An exact name, or a name prefix when `is_prefix` (declared as "prefix*").
    name = models.CharField(max_length=255)
    is_prefix = models.BooleanField(default=False)
    operations = models.JSONField(default=list)  # subset of ["create", "update", "delete"]
    exclusive = models.BooleanField(default=False)
    fence = models.BigIntegerField(null=True, blank=True)
    active = models.BooleanField(default=True)
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["kind_id", "name"]
        indexes = [
            models.Index(
                fields=["kind", "name"], name="ownership_active_idx", condition=Q(active=True)
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(exclusive=False) | Q(fence__isnull=False),
                name="ownership_lease_has_fence",
            ),
        ]

    def __str__(self) -> str:
        return self.pattern

    @property
    def pattern(self) -> str:
        return f"{self.kind_id}/{self.name}{'*' if self.is_prefix else ''}"


class ConflictStatus(models.TextChoices):
    OPEN = "open", "open"
    RESOLVED = "resolved", "resolved"


class ConflictOrigin(models.TextChoices):
    WRITE = "write", "stale write"
    UNDO = "undo", "undo after a later write"


class ResolutionChoice(models.TextChoices):
    KEEP_CURRENT = "keep_current", "keep current"
    TAKE_PROPOSED = "take_proposed", "take proposed"
    MERGE = "merge", "merge per field"


class Conflict(models.Model):
    """A refused stale write (or undo) waiting for its resolver."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    action = models.ForeignKey(
        "approvals.Action", on_delete=models.PROTECT, related_name="conflicts"
    )
    resource = models.ForeignKey(Resource, on_delete=models.PROTECT, related_name="conflicts")
    conflict_class = models.ForeignKey(ConflictClass, on_delete=models.PROTECT, related_name="+")
    origin = models.CharField(
        max_length=8, choices=ConflictOrigin.choices, default=ConflictOrigin.WRITE
    )
    resolver = models.CharField(max_length=150)
    # The group that may resolve it, denormalised from `resolver` for fast "mine" lists.
    resolver_group = models.CharField(max_length=150, blank=True)
    status = models.CharField(
        max_length=16, choices=ConflictStatus.choices, default=ConflictStatus.OPEN
    )
    # The target's version tokens (text; the managed store's counter as "41"; "0" for a
    # create's missing base).
    base_version = models.CharField(max_length=255)
    base_document = models.JSONField(default=dict)
    current_version = models.CharField(max_length=255)
    current_document = models.JSONField(default=dict)
    proposed_document = models.JSONField(default=dict)
    fields = models.JSONField(default=list)
    resolution = models.CharField(max_length=16, choices=ResolutionChoice.choices, blank=True)
    resolution_fields = models.JSONField(default=dict, blank=True)
    resolution_comment = models.TextField(blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolution_action = models.ForeignKey(
        "approvals.Action", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["status", "resolver_group", "created_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["action", "origin"], name="conflict_one_per_action_origin"
            ),
            models.CheckConstraint(
                condition=Q(status="open", resolved_at__isnull=True)
                | Q(status="resolved", resolved_at__isnull=False),
                name="conflict_resolved_has_time",
            ),
        ]

    def __str__(self) -> str:
        return f"conflict {self.id}"
