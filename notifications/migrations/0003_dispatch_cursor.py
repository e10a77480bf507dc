"""The notifications read the audit chain after a cursor instead of capturing inside each
event's transaction. An existing deployment starts its cursor at the chain's head, so no
event told before (or missed) is told again."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def cursor_at_the_head(apps: Any, schema_editor: Any) -> None:
    head = apps.get_model("audit", "AuditHead").objects.filter(pk=1).first()
    apps.get_model("notifications", "DispatchCursor").objects.update_or_create(
        pk=1, defaults={"audit_seq": head.seq if head else 0}
    )


class Migration(migrations.Migration):
    dependencies = [
        ("notifications", "0002_apprise_url_display"),
        ("audit", "0007_head_keeps_replaced_hash"),
    ]

    operations = [
        migrations.CreateModel(
            name="DispatchCursor",
            fields=[
                (
                    "id",
                    models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False),
                ),
                ("audit_seq", models.BigIntegerField(default=0)),
                ("updated_at", models.DateTimeField(auto_now=True)),
            ],
        ),
        migrations.RunPython(cursor_at_the_head, migrations.RunPython.noop),
    ]
