"""The head keeps the hash its last one-event append replaced.

A one-event append is now ONE UPDATE of the head (lock and move together) whose RETURNING
gives the event its seq, prev_hash and hash; RETURNING sees only the new row, so the UPDATE
also copies the hash it replaces into this column (audit/services.py, _APPEND). Adding a
column with a constant default rewrites nothing on PostgreSQL.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("audit", "0006_hash_without_like_index")]

    operations = [
        migrations.AddField(
            model_name="audithead",
            name="prev_hash",
            field=models.CharField(default="", editable=False, max_length=64),
        ),
    ]
