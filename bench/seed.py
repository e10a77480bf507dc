"""Bulk rows for the scale figures: 10⁷ chained audit events and 10⁶ actions in minutes.

Not the services: 10⁶ to 10⁷ audited rows through them would take hours, and these rows are only
the background the scale figures are measured against (the measured writes and polls go
through the product). Two things make the bulk fast enough for the default bench's budget:

- a seeded event differs from the next only in its seq, its details' counter and its
  prev_hash, so its canonical JSON is a template with three holes (checked against
  audit.chain's `event_hash` every `_CHECK_EVERY` events: a change to the hashed layout fails
  the seed instead of seeding a broken chain);
- each table's indexes but its primary key (and unique constraints a foreign key relies on)
  are dropped for the load and built again after it: a sort per index instead of 10⁷ random
  B-tree inserts each. The measured state has exactly the indexes it had before (checked).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, connection, transaction
from psycopg.copy import QueuedLibpqWriter

from approvals.models import Action
from audit.chain import canonical_json, event_hash, system_event_fields
from audit.linker import audit_link
from audit.models import AuditEvent, AuditHead
from ownership.models import Resource

_BATCH = 100_000
_CHECK_EVERY = 100_000
_SEQ_HOLE = 987_654_321_987_654  # a number no real seq or counter of the seed reaches
_PREV_HOLE = "p" * 64
_LABEL, _EVENT_TYPE = "bench-seed", "bench.seed"

# A table's indexes other than its primary key: plain indexes by their CREATE INDEX, unique
# constraints (none of them a foreign key's target) by their constraint definition.
_SECONDARY_INDEXES = """
SELECT 'index', indexname, indexdef FROM pg_indexes i
WHERE schemaname = current_schema() AND tablename = %(table)s
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)
UNION ALL
SELECT 'constraint', c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c
WHERE c.conrelid = %(table)s::regclass AND c.contype = 'u'
  AND NOT EXISTS (SELECT 1 FROM pg_constraint f WHERE f.contype = 'f' AND f.conindid = c.conindid)
ORDER BY 1, 2
"""

_COPY_EVENTS = (
    "COPY audit_auditevent (seq, created_at, actor_type, actor_id, actor_label, request_id, "
    "event_type, resource, run_id, action_id, details, prev_hash, hash) FROM STDIN"
)


def seed_scale(spec: dict[str, Any]) -> bool:
    """Bring the database up to the spec's totals, keeping the audit chain valid; then
    checkpoint (whether it could: `_checkpoint`)."""
    with transaction.atomic():
        _seed_audit(int(spec["audit_events"]))
    with transaction.atomic():
        _seed_rows(spec)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return _checkpoint()


def _checkpoint() -> bool:
    """Flush the load's dirty pages now (CHECKPOINT), so that the writes timed next do not
    share the disk with the background writing-out of a multi-gigabyte COPY — a database
    that grew to this size over months has no such load in flight. Needs a superuser or
    pg_checkpoint (the bench's default database user is one); False when refused."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("CHECKPOINT")
    except DatabaseError:
        return False
    return True


class _EventText:
    """A seeded event's canonical JSON with holes for seq (twice: the seq and the details'
    counter) and prev_hash, filled by string joins instead of a json.dumps per event."""

    def __init__(self, created_at: datetime) -> None:
        self.created_at = created_at
        text = canonical_json({"event": self._fields(_SEQ_HOLE), "prev_hash": _PREV_HOLE})
        head, prev_tail = text.split(_PREV_HOLE)
        self.parts = head.split(str(_SEQ_HOLE))
        self.prev_tail = prev_tail
        if len(self.parts) != 3 or _PREV_HOLE in prev_tail:
            raise RuntimeError("audit hash layout changed: fix bench/seed.py _EventText")

    def digest(self, seq: int, prev_hash: str) -> str:
        number = str(seq)
        text = f"{self.parts[0]}{number}{self.parts[1]}{number}{self.parts[2]}"
        return hashlib.sha256(f"{text}{prev_hash}{self.prev_tail}".encode()).hexdigest()

    def _fields(self, seq: int) -> dict[str, Any]:
        return system_event_fields(
            seq=seq,
            created_at=self.created_at,
            label=_LABEL,
            event_type=_EVENT_TYPE,
            details={"n": seq},
        )

    def checked(self, seq: int, prev_hash: str, digest: str) -> None:
        """Raise unless `digest` is the hash audit.chain gives the event."""
        if digest != event_hash(self._fields(seq), prev_hash):
            raise RuntimeError(f"seeded event #{seq} hashes differently from audit.chain's")


def _seed_audit(want_events: int) -> None:
    """Linked events appended by COPY under the head row's lock (the caller's transaction),
    numbered from a block of the sequence taken for them (a hole before it is a hole, as a
    rolled-back append leaves), after everything committed has been linked."""
    missing = max(0, want_events - AuditEvent.objects.count())
    if not missing:
        return
    audit_link(wait_seconds=5.0)
    head = AuditHead.objects.select_for_update().get(pk=1)
    if AuditEvent.objects.filter(seq__gt=head.seq).exists():
        raise RuntimeError("unlinked audit events past the head: is a writer running?")
    text = _EventText(datetime.now(UTC))
    with _indexes_rebuilt_after("audit_auditevent", rows=missing), connection.cursor() as wrapper:
        first = _sequence_block(wrapper, missing)
        seq, prev = _copy_events(wrapper.cursor, text, seq=first - 1, prev=head.hash, count=missing)
    AuditHead.objects.filter(pk=1).update(seq=seq, hash=prev)


def _sequence_block(cursor: Any, count: int) -> int:
    """The first of `count` seqs taken from the append's sequence (no writer runs meanwhile)."""
    cursor.execute("SELECT nextval('audit_auditevent_seq')")
    first = int(cursor.fetchone()[0])
    cursor.execute("SELECT setval('audit_auditevent_seq', %s)", [first + count - 1])
    return first


def _copy_events(
    cursor: Any, text: _EventText, *, seq: int, prev: str, count: int
) -> tuple[int, str]:
    """COPY `count` events chained after (seq, prev); the new head's (seq, hash)."""
    stamp = text.created_at.isoformat()
    # The queued writer sends from a thread: PostgreSQL loads one batch while we hash the next.
    with cursor.copy(_COPY_EVENTS, writer=QueuedLibpqWriter(cursor)) as copy:
        for start in range(0, count, _BATCH):
            lines = []
            for _ in range(min(_BATCH, count - start)):
                seq += 1
                digest = text.digest(seq, prev)
                if seq % _CHECK_EVERY == 1:
                    text.checked(seq, prev, digest)
                lines.append(
                    f"{seq}\t{stamp}\tsystem\t\t{_LABEL}\t\t{_EVENT_TYPE}\t\t\\N\t\\N"
                    f'\t{{"n": {seq}}}\t{prev}\t{digest}\n'
                )
                prev = digest
            copy.write("".join(lines))
    return seq, prev


_INSERT_RESOURCES = (
    "INSERT INTO ownership_resource (kind_id, name, document, version, last_fence, deleted, "
    "owner_group, created_at, updated_at) "
    "SELECT %(kind)s, 'scale-' || g, '{\"n\": 0}'::jsonb, 1, 0, false, 'platform', now(), now() "
    "FROM generate_series(%(first)s::bigint, %(last)s::bigint) g"
)
_INSERT_ACTIONS = (
    "INSERT INTO approvals_action (id, run_id, agent_id, kind_id, name, operation, "
    "payload_format, payload, observed_version, conflict_class_id, status, revision, reason, "
    "idempotency_key, request_id, paused_reason, attempts, created_at, updated_at) "
    "SELECT gen_random_uuid(), %(run_id)s, %(agent_id)s, %(kind)s, 'scale-' || g, 'update', "
    "'merge_patch', '{\"n\": 1}'::jsonb, 1, %(conflict_class)s, 'applied', 3, '', '', '', '', 1, "
    "now(), now() FROM generate_series(%(first)s::bigint, %(last)s::bigint) g"
)


def _seed_rows(spec: dict[str, Any]) -> None:
    """Resources and applied actions by INSERT … SELECT generate_series."""
    params = {name: spec[name] for name in ("kind", "run_id", "agent_id", "conflict_class")}
    for table, sql, have, want in (
        ("ownership_resource", _INSERT_RESOURCES, Resource.objects.count(), spec["resources"]),
        ("approvals_action", _INSERT_ACTIONS, Action.objects.count(), spec["actions"]),
    ):
        rows = int(want) - have
        if rows <= 0:
            continue
        with _indexes_rebuilt_after(table, rows=rows), connection.cursor() as cursor:
            cursor.execute(sql, {**params, "first": have + 1, "last": int(want)})


@contextmanager
def _indexes_rebuilt_after(table: str, *, rows: int) -> Iterator[None]:
    """Drop `table`'s secondary indexes for a load of `rows` rows and build them again after
    it, in the caller's transaction; a small load keeps them (not worth a sort each)."""
    if rows < 50_000:
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute(_SECONDARY_INDEXES, {"table": table})
        before = cursor.fetchall()
        for kind, name, _ in before:
            drop = f'DROP INDEX "{name}"' if kind == "index" else f'DROP CONSTRAINT "{name}"'
            cursor.execute(drop if kind == "index" else f'ALTER TABLE "{table}" {drop}')
    yield
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL maintenance_work_mem = '512MB'")
        # Django's foreign keys are deferred: their checks of the load must run before a
        # constraint can be added in the same transaction.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        for kind, name, definition in before:
            if kind == "index":
                cursor.execute(definition)
            else:
                cursor.execute(f'ALTER TABLE "{table}" ADD CONSTRAINT "{name}" {definition}')
        cursor.execute(_SECONDARY_INDEXES, {"table": table})
        if cursor.fetchall() != before:
            raise RuntimeError(f"{table}: the rebuilt indexes differ from the dropped ones")
