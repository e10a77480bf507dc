"""Claims: "Ana is on it" — one person working an approval or a conflict for a while.

A claim is advisory (the decision services never read it): it tells the others who is
on an item so two operators do not silently work the same one. At most one claim per
item (a unique constraint: two people claiming at once cannot both win); a released
claim is deleted, an expired one is ignored and replaced by the next taker."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class ClaimSubject(models.TextChoices):
    APPROVAL = "approval", "approval"
    CONFLICT = "conflict", "conflict"


class Claim(models.Model):
    subject = models.CharField(max_length=16, choices=ClaimSubject.choices)
    # The approval's or the conflict's id (two apps' rows: no foreign key, the service
    # checks the item exists and the person may work it before a claim is written).
    subject_id = models.UUIDField()
    holder = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    taken_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["subject", "subject_id"], name="claim_one_per_item")
        ]

    def __str__(self) -> str:
        return f"{self.subject} {self.subject_id} claimed by {self.holder_id}"
