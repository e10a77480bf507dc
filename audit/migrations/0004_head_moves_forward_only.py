"""The audit head row is protected like the events: it only moves forward.

A trigger refuses an UPDATE that moves the head backwards (its seq decreases,
or its hash changes while seq stays) or renumbers it, and any DELETE or
TRUNCATE of the head table. Appends (seq rising with a new hash) pass. The
same maintenance switch as the events' trigger applies: the setting
`airlock.audit_maintenance = 'on'` in a superuser session (the test suite's
table flushes) lets anything through.
"""

from __future__ import annotations

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION audit_head_guard() RETURNS trigger AS $$
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
    IF TG_OP = 'UPDATE' THEN
        IF NEW.id = OLD.id AND (NEW.seq > OLD.seq
                                OR (NEW.seq = OLD.seq AND NEW.hash = OLD.hash)) THEN
            RETURN NEW;
        END IF;
        RAISE EXCEPTION 'audit_audithead only moves forward (seq %% -> %% refused)',
            OLD.seq, NEW.seq USING ERRCODE = 'insufficient_privilege';
    END IF;
    RAISE EXCEPTION 'audit_audithead only moves forward (%% refused)', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER audit_head_forward_only
    BEFORE UPDATE OR DELETE ON audit_audithead
    FOR EACH ROW EXECUTE FUNCTION audit_head_guard();

CREATE TRIGGER audit_head_no_truncate
    BEFORE TRUNCATE ON audit_audithead
    FOR EACH STATEMENT EXECUTE FUNCTION audit_head_guard();
"""

DROP = """
DROP TRIGGER IF EXISTS audit_head_no_truncate ON audit_audithead;
DROP TRIGGER IF EXISTS audit_head_forward_only ON audit_audithead;
DROP FUNCTION IF EXISTS audit_head_guard();
"""


def create_triggers(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop_triggers(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("audit", "0003_maintenance_needs_superuser")]

    operations = [migrations.RunPython(create_triggers, drop_triggers)]
