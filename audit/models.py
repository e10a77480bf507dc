"""The append-only, hash-chained audit trail."""

from __future__ import annotations

from django.db import models


class ActorType(models.TextChoices):
    PERSON = "person", "person"
    AGENT = "agent", "agent"
    RUN = "run", "run"
    SYSTEM = "system", "system"


class AuditEvent(models.Model):
    """One event. `hash` = SHA-256 over the canonical JSON of the event and `prev_hash`.

    On PostgreSQL an event is stored unlinked (`prev_hash` and `hash` empty, `seq` from a
    sequence) and the linker gives it its link once it has committed (audit/linker.py);
    a trigger refuses every other UPDATE, any DELETE and TRUNCATE. A hole in `seq` is an
    append that rolled back: the links prove nothing was removed. On SQLite an append is
    linked at once under the AuditHead row.
    """

    seq = models.BigIntegerField(primary_key=True)
    created_at = models.DateTimeField()
    actor_type = models.CharField(max_length=8, choices=ActorType.choices)
    actor_id = models.CharField(max_length=64, blank=True)
    actor_label = models.CharField(max_length=200, blank=True)
    request_id = models.CharField(max_length=128, blank=True)
    event_type = models.CharField(max_length=64)
    resource = models.CharField(max_length=320, blank=True)
    run_id = models.UUIDField(null=True, blank=True)
    action_id = models.UUIDField(null=True, blank=True)
    details = models.JSONField(default=dict)
    prev_hash = models.CharField(max_length=64)
    # Unique through a constraint, not `unique=True`: on PostgreSQL that would add a second
    # index (varchar_pattern_ops, for LIKE) that no query uses and every append must update.
    hash = models.CharField(max_length=64)

    class Meta:
        ordering = ["seq"]
        # Unique among linked events: an unlinked one's hash is empty until the linker links
        # it (migration 0008, audit/linker.py).
        constraints = [
            models.UniqueConstraint(
                fields=["hash"], condition=~models.Q(hash=""), name="audit_auditevent_linked_hash"
            )
        ]
        indexes = [
            models.Index(fields=["resource", "seq"]),
            models.Index(fields=["run_id", "seq"]),
            models.Index(fields=["action_id", "seq"]),
            models.Index(fields=["event_type", "seq"]),
            models.Index(fields=["actor_type", "actor_id", "seq"]),
            models.Index(fields=["created_at"]),
        ]

    def __str__(self) -> str:
        return f"#{self.seq} {self.event_type}"


class AuditHead(models.Model):
    """The single row that serialises appends: the last seq and hash."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    seq = models.BigIntegerField(default=0)
    hash = models.CharField(max_length=64, default="0" * 64)
    # The hash the last one-event append replaced: that append's UPDATE sets it so that its
    # RETURNING (which sees only the new row) can give the event its prev_hash. Other
    # writers of the head (a batch append) leave it behind; nothing else reads it.
    prev_hash = models.CharField(max_length=64, default="", editable=False)

    def __str__(self) -> str:
        return f"audit head #{self.seq}"
