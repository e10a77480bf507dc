"""What actions and plan steps share: both describe one conditional write, and both
carry an ETag that moves with each transition."""

from __future__ import annotations

from typing import ClassVar

from django.db import models

from approvals.models.choices import PayloadFormat, WriteOperation


class ConditionalWrite(models.Model):
    """One conditional write of `kind/name`: the operation, its payload and the
    version it was based on, under the conflict class of that operation."""

    kind = models.ForeignKey("ownership.ResourceKind", on_delete=models.PROTECT, related_name="+")
    name = models.CharField(max_length=255)
    operation = models.CharField(max_length=16, choices=WriteOperation.choices)
    payload_format = models.CharField(max_length=16, choices=PayloadFormat.choices)
    payload = models.JSONField(null=True, blank=True)
    # The version the agent observed (If-Match), as the target's token: the managed store's
    # counter as text ("41"), or an external target's opaque version, compared exactly.
    # Null for a create (If-None-Match: *).
    observed_version = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001 (None: no version)
    conflict_class = models.ForeignKey(
        "ownership.ConflictClass", on_delete=models.PROTECT, related_name="+"
    )

    class Meta:
        abstract = True

    @property
    def resource_identifier(self) -> str:
        return f"{self.kind_id}/{self.name}"


class Revisioned(models.Model):
    """A row whose `revision` is bumped on every transition: its ETag (with the
    subclass's prefix) changes exactly when a long-poller has something new to read."""

    ETAG_PREFIX: ClassVar[str]
    FINAL_STATUSES: ClassVar[frozenset[str]]
    status: str  # each subclass's own status field, with its own choices

    revision = models.PositiveIntegerField(default=1)

    class Meta:
        abstract = True

    @property
    def etag(self) -> str:
        return f'"{self.ETAG_PREFIX}{self.revision}"'

    @property
    def is_final(self) -> bool:
        return self.status in self.FINAL_STATUSES
