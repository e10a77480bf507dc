"""Choices shared by actions and plan steps (both describe one conditional write)."""

from __future__ import annotations

from django.db import models


class WriteOperation(models.TextChoices):
    CREATE = "create", "create"
    UPDATE = "update", "update"
    DELETE = "delete", "delete"


class PayloadFormat(models.TextChoices):
    REPLACE = "replace", "full document (PUT)"
    MERGE_PATCH = "merge_patch", "JSON merge patch (PATCH)"
    DELETE = "delete", "delete"
    RESOLUTION = "resolution", "document chosen by a conflict resolution"
