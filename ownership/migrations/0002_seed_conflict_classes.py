"""The five conflict classes from the design, and the groups they name."""

from __future__ import annotations

from django.db import migrations

from ownership.seed_data import CLASS_DEFAULTS, CLASSES, GROUPS

def seed(apps, schema_editor):  # type: ignore[no-untyped-def]
    ConflictClass = apps.get_model("ownership", "ConflictClass")
    Group = apps.get_model("auth", "Group")
    # Only the fields this migration's model has: later migrations set later fields.
    fields = {field.name for field in ConflictClass._meta.get_fields()}
    for row in CLASSES:
        values = {k: v for k, v in {**CLASS_DEFAULTS, **row}.items() if k in fields}
        ConflictClass.objects.update_or_create(slug=row["slug"], defaults=values)
    for name in GROUPS:
        Group.objects.get_or_create(name=name)


class Migration(migrations.Migration):
    dependencies = [
        ("ownership", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
