"""Fencing tokens come from PostgreSQL, never from Redis, so they never go backwards.

PostgreSQL: a sequence (nextval is non-transactional and lock-free).
Elsewhere (the embedded SQLite default): the single FenceCounter row.
"""

from __future__ import annotations

from django.db import migrations


def create(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("CREATE SEQUENCE IF NOT EXISTS airlock_fence_seq START 1")
    else:
        FenceCounter = apps.get_model("console", "FenceCounter")
        FenceCounter.objects.get_or_create(pk=1, defaults={"value": 0})


def drop(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP SEQUENCE IF EXISTS airlock_fence_seq")


class Migration(migrations.Migration):
    dependencies = [("console", "0001_initial")]

    operations = [migrations.RunPython(create, drop)]
