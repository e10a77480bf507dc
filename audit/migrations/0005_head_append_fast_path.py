"""Appends skip the head row's guard function; the head row keeps its update chain short.

Every append moves the head forward, and for that move the guard (0004) always answers
"pass" — yet it was a PL/pgSQL call on each append. The trigger now has a WHEN clause, which
PostgreSQL evaluates without calling the function: a forward move (same id, higher seq) does
not fire it; everything else (a backward move, a renumbering, a rewritten hash, a DELETE,
a TRUNCATE) still reaches the unchanged function, maintenance switch included. DELETE gets
its own trigger because a WHEN clause that reads NEW cannot apply to a DELETE.

The single head row is updated once per append. At the default fillfactor its page fills
with dead versions before PostgreSQL prunes it (and an update that finds no room goes to a
new page: the one-row table grew to megabytes under the bench), so every lookup walks a long
update chain. A fillfactor of 10 makes each access prune the page early.
"""

from __future__ import annotations

from django.db import migrations

FORWARD = """
DROP TRIGGER IF EXISTS audit_head_forward_only ON audit_audithead;
CREATE TRIGGER audit_head_forward_only
    BEFORE UPDATE ON audit_audithead
    FOR EACH ROW
    WHEN (NOT (NEW.id = OLD.id AND NEW.seq > OLD.seq))
    EXECUTE FUNCTION audit_head_guard();
CREATE TRIGGER audit_head_no_delete
    BEFORE DELETE ON audit_audithead
    FOR EACH ROW EXECUTE FUNCTION audit_head_guard();
ALTER TABLE audit_audithead SET (fillfactor = 10);
"""

BACKWARD = """
DROP TRIGGER IF EXISTS audit_head_no_delete ON audit_audithead;
DROP TRIGGER IF EXISTS audit_head_forward_only ON audit_audithead;
CREATE TRIGGER audit_head_forward_only
    BEFORE UPDATE OR DELETE ON audit_audithead
    FOR EACH ROW EXECUTE FUNCTION audit_head_guard();
ALTER TABLE audit_audithead RESET (fillfactor);
"""


def forward(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FORWARD)


def backward(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(BACKWARD)


class Migration(migrations.Migration):
    dependencies = [("audit", "0004_head_moves_forward_only")]

    operations = [migrations.RunPython(forward, backward)]
