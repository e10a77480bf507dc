"""Re-create the reference rows every database must have (idempotent).

Migrations create them once; the test suite's table flushes remove them, so
tests call this before each test.
"""

from __future__ import annotations

from django.contrib.auth.models import Group
from django.db import connection

from audit.models import AuditHead
from console.models import FenceCounter
from ownership.models import ConflictClass
from ownership.seed_data import CLASS_DEFAULTS, CLASSES, GROUPS


def ensure_reference_data() -> None:
    for row in CLASSES:
        ConflictClass.objects.get_or_create(slug=row["slug"], defaults={**CLASS_DEFAULTS, **row})
    for name in GROUPS:
        Group.objects.get_or_create(name=name)
    AuditHead.objects.get_or_create(pk=1, defaults={"seq": 0, "hash": "0" * 64})
    if connection.vendor != "postgresql":
        FenceCounter.objects.get_or_create(pk=1, defaults={"value": 0})
