"""Standing grants' class flag: allowed by default, off for the seeded classes that forbid
them (ownership/seed_data.py: access_change, replace_shared_document)."""

from django.db import migrations, models

from ownership.seed_data import CLASSES


def forbid_seeded(apps, schema_editor):  # type: ignore[no-untyped-def]
    ConflictClass = apps.get_model("ownership", "ConflictClass")
    forbidding = [row["slug"] for row in CLASSES if row.get("grants_allowed") is False]
    ConflictClass.objects.filter(slug__in=forbidding).update(grants_allowed=False)


class Migration(migrations.Migration):
    dependencies = [
        ("ownership", "0003_opaque_versions"),
    ]

    operations = [
        migrations.AddField(
            model_name="conflictclass",
            name="grants_allowed",
            field=models.BooleanField(default=True),
        ),
        migrations.RunPython(forbid_seeded, migrations.RunPython.noop),
    ]
