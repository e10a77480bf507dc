"""The kill switch and the fence counter (SQLite only; PostgreSQL uses a sequence)."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class KillSwitch(models.Model):
    """Safe mode for a scope: `*` (everything) or `kind/prefix*`.

    While engaged no write in the scope executes; queued work pauses with the
    reason and resumes, in order, on release.
    """

    scope = models.CharField(max_length=300, unique=True)
    engaged = models.BooleanField(default=False)
    reason = models.TextField(blank=True)
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    changed_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["scope"]

    def __str__(self) -> str:
        return f"kill switch {self.scope} ({'engaged' if self.engaged else 'released'})"

    def covers(self, resource_identifier: str) -> bool:
        if self.scope == "*":
            return True
        if self.scope.endswith("*"):
            return resource_identifier.startswith(self.scope[:-1])
        return resource_identifier == self.scope


class FenceCounter(models.Model):
    """A single-row counter used for fencing tokens where there are no sequences."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    value = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"fence counter at {self.value}"
