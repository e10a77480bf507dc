"""Events commit unlinked; one linker chains them (audit/linker.py).

- `audit_auditevent_seq`: an append takes its seq from this sequence instead of from the head
  row, so appends no longer queue on one row held through their commits. It starts after the
  highest seq stored. A rolled-back append leaves a hole in the numbers: the chain's links
  (each event's prev_hash), not contiguous numbers, prove that nothing was removed.
- An event is stored with `prev_hash` and `hash` empty and linked later, in seq order, by the
  linker. The append-only trigger lets exactly that through: an UPDATE of an event whose hash
  is empty that sets its hash and prev_hash and changes nothing else. Every other UPDATE, any
  DELETE and TRUNCATE stay refused (the maintenance switch as before).
- The hash stays unique among linked events: a partial unique index (`hash <> ''`) replaces
  the unique constraint, which every unlinked event's empty hash would break.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

SEQUENCE = "audit_auditevent_seq"

CREATE = f"""
CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint OWNED BY audit_auditevent.seq;
SELECT setval('{SEQUENCE}',
              GREATEST((SELECT max(seq) FROM audit_auditevent),
                       (SELECT max(seq) FROM audit_audithead), 0) + 1,
              false);

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
    -- The linker's one change: an unlinked event gets its link, nothing else moves.
    IF TG_OP = 'UPDATE' AND OLD.hash = '' AND NEW.hash <> '' AND NEW.prev_hash <> ''
       AND NEW.seq = OLD.seq
       AND NEW.created_at = OLD.created_at
       AND NEW.actor_type = OLD.actor_type
       AND NEW.actor_id = OLD.actor_id
       AND NEW.actor_label = OLD.actor_label
       AND NEW.request_id = OLD.request_id
       AND NEW.event_type = OLD.event_type
       AND NEW.resource = OLD.resource
       AND NEW.run_id IS NOT DISTINCT FROM OLD.run_id
       AND NEW.action_id IS NOT DISTINCT FROM OLD.action_id
       AND NEW.details = OLD.details THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'audit_auditevent is append-only (%% refused)', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;

ALTER TABLE audit_auditevent DROP CONSTRAINT IF EXISTS audit_auditevent_hash_key;
CREATE UNIQUE INDEX IF NOT EXISTS audit_auditevent_linked_hash
    ON audit_auditevent (hash) WHERE hash <> '';
"""

DROP = f"""
DROP INDEX IF EXISTS audit_auditevent_linked_hash;
ALTER TABLE audit_auditevent ADD CONSTRAINT audit_auditevent_hash_key UNIQUE (hash);
DROP SEQUENCE IF EXISTS {SEQUENCE};
"""  # the previous trigger function comes back with migration 0003's text


def _forward(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def _backward(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("audit", "0007_head_keeps_replaced_hash")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveConstraint(
                    model_name="auditevent", name="audit_auditevent_hash_key"
                ),
                migrations.AddConstraint(
                    model_name="auditevent",
                    constraint=models.UniqueConstraint(
                        fields=("hash",),
                        condition=~models.Q(hash=""),
                        name="audit_auditevent_linked_hash",
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(_forward, _backward)],
        )
    ]
