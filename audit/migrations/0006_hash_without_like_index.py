"""The event hash stays unique, without the LIKE index that `unique=True` adds on PostgreSQL.

`unique=True` on a CharField makes Django create, beside the unique constraint, an index with
varchar_pattern_ops for LIKE queries. Nothing looks an event up by a hash prefix (an anchor is
looked up whole, through the unique index), and each append paid for one more B-tree insert
of a random 64-character key. The state moves to a named UniqueConstraint under the name the
existing constraint already has (PostgreSQL's `<table>_<column>_key`), so only the unused index
is dropped; the constraint and its index stay as they are.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

LIKE_INDEX = "audit_auditevent_hash_d0c402da_like"


def _drop_like_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f'DROP INDEX IF EXISTS "{LIKE_INDEX}"')


def _create_like_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f'CREATE INDEX IF NOT EXISTS "{LIKE_INDEX}" '
            'ON "audit_auditevent" ("hash" varchar_pattern_ops)'
        )


class Migration(migrations.Migration):
    dependencies = [("audit", "0005_head_append_fast_path")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="auditevent",
                    name="hash",
                    field=models.CharField(max_length=64),
                ),
                migrations.AddConstraint(
                    model_name="auditevent",
                    constraint=models.UniqueConstraint(
                        fields=("hash",), name="audit_auditevent_hash_key"
                    ),
                ),
            ],
            database_operations=[
                migrations.RunPython(_drop_like_index, _create_like_index),
            ],
        )
    ]
