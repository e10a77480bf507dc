"""Only a superuser session may switch the audit table's append-only trigger off.

The maintenance setting (used by the test suite's table flushes) is a plain GUC
that any session can SET; requiring a superuser as well means the application's
own role cannot rewrite history even if it sets it. A superuser can drop the
trigger anyway; the hash chain, anchored outside the database, is what detects that.
"""

from __future__ import annotations

from django.db import migrations

REPLACE = """
CREATE OR REPLACE FUNCTION audit_refuse_change() RETURNS trigger AS $$
BEGIN
    IF coalesce(current_setting('airlock.audit_maintenance', true), '') = 'on'
       AND (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
        IF TG_LEVEL = 'ROW' AND TG_OP = 'DELETE' THEN
            RETURN OLD;
        ELSIF TG_LEVEL = 'ROW' THEN
            RETURN NEW;
        END IF;
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'audit_auditevent is append-only (%% refused)', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;
"""


def replace_function(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(REPLACE)


class Migration(migrations.Migration):
    dependencies = [("audit", "0002_head_and_append_only")]

    operations = [migrations.RunPython(replace_function, migrations.RunPython.noop)]
