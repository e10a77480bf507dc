"""The audit head row, and (PostgreSQL) triggers that make the table append-only.

The triggers refuse UPDATE, DELETE and TRUNCATE unless the session has set
`airlock.audit_maintenance = 'on'`. Only the test suite does that (Django's
test teardown truncates every table); the hash chain, not the trigger, is
what makes tampering evident.
"""

from __future__ import annotations

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION audit_refuse_change() RETURNS trigger AS $$
BEGIN
    IF coalesce(current_setting('airlock.audit_maintenance', true), '') = 'on' THEN
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

CREATE TRIGGER audit_event_no_update_delete
    BEFORE UPDATE OR DELETE ON audit_auditevent
    FOR EACH ROW EXECUTE FUNCTION audit_refuse_change();

CREATE TRIGGER audit_event_no_truncate
    BEFORE TRUNCATE ON audit_auditevent
    FOR EACH STATEMENT EXECUTE FUNCTION audit_refuse_change();
"""

DROP = """
DROP TRIGGER IF EXISTS audit_event_no_truncate ON audit_auditevent;
DROP TRIGGER IF EXISTS audit_event_no_update_delete ON audit_auditevent;
DROP FUNCTION IF EXISTS audit_refuse_change();
"""


def create_head(apps, schema_editor):  # type: ignore[no-untyped-def]
    AuditHead = apps.get_model("audit", "AuditHead")
    AuditHead.objects.get_or_create(pk=1, defaults={"seq": 0, "hash": "0" * 64})


def create_triggers(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop_triggers(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("audit", "0001_initial")]

    operations = [
        migrations.RunPython(create_head, migrations.RunPython.noop),
        migrations.RunPython(create_triggers, drop_triggers),
    ]
