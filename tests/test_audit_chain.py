"""The audit chain: tamper evidence, the append-only trigger, concurrent appenders
in separate processes, the audit_verify command and the list selector."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from audit import details as details_rules
from audit.chain import GENESIS_HASH, event_hash, system_event_fields
from audit.linker import audit_link
from audit.models import AuditEvent, AuditHead
from audit.selectors import audit_list
from audit.services import (
    Actor,
    audit_append,
    audit_append_if,
    audit_append_many,
    audit_deferred,
)
from audit.verify import verify_chain
from engine.core.errors import ValidationFailed
from tests.conftest import ROOT, subprocess_env
from tests.fixtures.core import spawn_worker


def _append(count: int, **kwargs: Any) -> list[AuditEvent]:
    """`count` events appended, then linked (audit/linker.py): as stored, in seq order."""
    seqs = [
        audit_append(
            event_type=kwargs.get("event_type", "test.event"),
            actor=kwargs.get("actor", Actor.system("test")),
            resource=kwargs.get("resource", "notification-policy/prod-alerts"),
            run_id=kwargs.get("run_id"),
            details={"index": index},
        ).seq
        for index in range(count)
    ]
    audit_link()
    return list(AuditEvent.objects.filter(seq__in=seqs).order_by("seq"))


def _sql(statement: str, params: list[Any] | None = None) -> None:
    # The test connection has airlock.audit_maintenance on (conftest): tampering is possible.
    with connection.cursor() as cursor:
        cursor.execute(statement, params or [])


@pytest.mark.django_db
def test_an_untouched_chain_verifies_and_links_every_event() -> None:
    events = _append(10)
    result = verify_chain()
    assert result.ok and result.events == 10 and result.first_bad_seq is None
    assert [e.seq for e in events] == list(range(1, 11))
    assert events[0].prev_hash == GENESIS_HASH
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(events))
    assert result.head_hash == events[-1].hash == AuditHead.objects.get().hash
    stored = AuditEvent.objects.get(seq=5)
    assert stored.hash == events[4].hash and stored.details == {"index": 4}


@pytest.mark.django_db
def test_the_hash_covers_exactly_what_jsonb_gives_back() -> None:
    audit_append(
        event_type="test.odd",
        actor=Actor("agent", str(uuid.uuid4()), "bot ünïcode"),
        run_id=str(uuid.uuid4()).upper(),
        details={
            "big": 1e16,
            "huge": 1.5e300,
            "tiny": 1.5e-10,
            "float": 0.1 + 0.2,
            "nan": float("nan"),
            "nul": "a\x00b",
            "nested": {"z": [1, 2.0, None], "a": True},
            "token": "rt_secretsecretsecret",
            "note": "called with ak_abcdefghijkl",
        },
    )
    assert verify_chain().ok
    details = AuditEvent.objects.get().details
    assert details["token"] == "[redacted]"
    assert "ak_abcdefghijkl" not in details["note"]


@pytest.mark.django_db
def test_an_edited_row_is_detected_at_its_seq() -> None:
    _append(10)
    _sql("UPDATE audit_auditevent SET details = '{\"index\": 99}' WHERE seq = 4")
    result = verify_chain()
    assert not result.ok and result.first_bad_seq == 4 and result.problem == "hash mismatch"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("statements", "first_bad_seq"),
    [
        # Found where the link breaks: the event after the hole names a hash no event has.
        (["DELETE FROM audit_auditevent WHERE seq = 4"], 5),
        # Checked against the head row: nothing after seq 8 says a tail is missing.
        (["DELETE FROM audit_auditevent WHERE seq >= 9"], 9),
        (
            [
                "UPDATE audit_auditevent SET seq = -4 WHERE seq = 4",
                "UPDATE audit_auditevent SET seq = 4 WHERE seq = 5",
                "UPDATE audit_auditevent SET seq = 5 WHERE seq = -4",
            ],
            4,
        ),
    ],
    ids=["a-deleted-row", "a-deleted-tail", "two-swapped-rows"],
)
def test_a_missing_or_moved_row_is_detected_at_the_first_bad_seq(
    statements: list[str], first_bad_seq: int
) -> None:
    _append(10)
    for statement in statements:
        _sql(statement)
    result = verify_chain()
    assert not result.ok and result.first_bad_seq == first_bad_seq


def _forged_row(seq: int, prev_hash: str, *, valid_hash: bool) -> list[Any]:
    now = timezone.now()
    fields = system_event_fields(
        seq=seq,
        created_at=now,
        label="forger",
        event_type="write.applied",
        resource="notification-policy/prod-alerts",
        details={"forged": True},
    )
    digest = event_hash(fields, prev_hash)
    if not valid_hash:
        digest = "f" * 64
    return [seq, now, "system", "", "forger", "", "write.applied",
            "notification-policy/prod-alerts", '{"forged": true}', prev_hash, digest]  # fmt: skip


_INSERT = (
    "INSERT INTO audit_auditevent (seq, created_at, actor_type, actor_id, actor_label, "
    "request_id, event_type, resource, details, prev_hash, hash) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s)"
)


def _shift_up_from(seq: int, last: int) -> None:
    for moving in range(last, seq - 1, -1):
        _sql("UPDATE audit_auditevent SET seq = seq + 1 WHERE seq = %s", [moving])


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("valid_hash", "first_bad_seq"),
    [
        (False, 6),
        # The forged row itself is well formed; the chain breaks where the real
        # event 6 (now at 7) no longer hashes.
        (True, 7),
    ],
    ids=["a-naive-row-at-its-seq", "a-row-with-a-valid-hash-at-the-next-link"],
)
def test_an_inserted_row_is_detected(valid_hash: bool, first_bad_seq: int) -> None:
    events = _append(10)
    _shift_up_from(6, 10)
    _sql(_INSERT, _forged_row(6, events[4].hash, valid_hash=valid_hash))
    result = verify_chain()
    assert not result.ok and result.first_bad_seq == first_bad_seq


@pytest.mark.django_db
def test_a_row_appended_behind_the_heads_back_is_detected() -> None:
    events = _append(10)
    _sql(_INSERT, _forged_row(11, events[-1].hash, valid_hash=True))
    result = verify_chain()
    assert not result.ok and result.first_bad_seq == 11


@pytest.mark.django_db
@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE audit_auditevent SET event_type = 'x' WHERE seq = 1",
        "DELETE FROM audit_auditevent WHERE seq = 1",
        "TRUNCATE audit_auditevent",
    ],
)
def test_the_trigger_refuses_changes_outside_maintenance(statement: str) -> None:
    _append(2)
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        _sql("SET LOCAL airlock.audit_maintenance = 'off'")
        _sql(statement)
    assert AuditEvent.objects.count() == 2
    assert verify_chain().ok


@pytest.mark.django_db
def test_a_rolled_back_append_leaves_a_hole_in_the_numbers_not_a_break() -> None:
    _append(3)
    with pytest.raises(RuntimeError), transaction.atomic():
        audit_append(event_type="test.rolled-back", actor=Actor.system("test"))
        audit_append(event_type="test.rolled-back", actor=Actor.system("test"))
        raise RuntimeError("the service failed after auditing")
    _append(1)
    assert list(AuditEvent.objects.values_list("seq", flat=True)) == [1, 2, 3, 6]
    result = verify_chain()
    assert result.ok and result.events == 6


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_four_processes_appending_concurrently_leave_one_whole_chain() -> None:
    per_process = 100
    processes = [
        spawn_worker("append", "--count", str(per_process), "--label", f"writer-{index}")
        for index in range(4)
    ]
    kept = 0
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]
        kept += json.loads(out.strip().splitlines()[-1])["kept"]
    # Per writer: one in ten rolled back, one in ten a batch of two.
    assert kept == 4 * per_process
    audit_link()
    seqs = list(AuditEvent.objects.order_by("seq").values_list("seq", flat=True))
    assert len(seqs) == kept and AuditHead.objects.get().seq == seqs[-1]
    # Every kept event is linked; the rolled-back ones left holes in the numbers only.
    assert not AuditEvent.objects.filter(hash="").exists()
    result = verify_chain()
    assert result.ok and result.events == seqs[-1]
    writers = set(AuditEvent.objects.values_list("actor_label", flat=True))
    assert sorted(writers) == [f"writer-{i}" for i in range(4)]
    # The writers really interleaved (not one after the other).
    labels = list(AuditEvent.objects.order_by("seq").values_list("actor_label", flat=True))
    switches = sum(1 for a, b in itertools.pairwise(labels) if a != b)
    assert switches > 3


def _verify_command() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "audit_verify"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_audit_verify_prints_the_head_and_exits_non_zero_naming_the_first_bad_seq() -> None:
    events = _append(6)
    ok = _verify_command()
    assert ok.returncode == 0, ok.stderr
    assert "events: 6" in ok.stdout
    assert f"head: {events[-1].hash}" in ok.stdout

    _sql("UPDATE audit_auditevent SET actor_label = 'someone else' WHERE seq = 3")
    bad = _verify_command()
    assert bad.returncode == 1
    assert "first bad seq 3" in bad.stderr
    assert f"head: {events[-1].hash}" in bad.stdout and "events: 6" in bad.stdout
    assert "verified: 2 events" in bad.stdout


@pytest.mark.django_db
def test_audit_verify_checks_an_anchored_hash() -> None:
    events = _append(3)
    call_command("audit_verify", anchor=events[1].hash, stdout=open("/dev/null", "w"))  # noqa: SIM115
    with pytest.raises(CommandError, match="no longer in the chain"):
        call_command("audit_verify", anchor="0" * 63 + "1", stdout=open("/dev/null", "w"))  # noqa: SIM115


@pytest.mark.django_db
def test_audit_list_filters_and_pages_newest_first() -> None:
    run_id = uuid.uuid4()
    _append(5, resource="notification-policy/a", run_id=run_id, event_type="write.applied")
    _append(3, resource="dns-record/b", event_type="write.refused")
    page = audit_list(filters={"resource": "notification-policy/a"}, limit=2)
    assert [e.seq for e in page.items] == [5, 4]
    assert page.next is not None
    second = audit_list(filters={"resource": "notification-policy/a"}, cursor=page.next, limit=2)
    assert [e.seq for e in second.items] == [3, 2]
    third = audit_list(filters={"resource": "notification-policy/a"}, cursor=second.next, limit=2)
    assert [e.seq for e in third.items] == [1] and third.next is None
    assert len(audit_list(filters={"run": str(run_id)}).items) == 5
    assert len(audit_list(filters={"resource": "dns-record/*"}).items) == 3
    assert len(audit_list(filters={"event_type": "write.*"}).items) == 8
    oldest = audit_list(filters={}, limit=3, newest_first=False)
    assert [e.seq for e in oldest.items] == [1, 2, 3]
    with pytest.raises(ValidationFailed):
        audit_list(filters={"run": "not-a-uuid"})
    with pytest.raises(ValidationFailed):
        audit_list(cursor="garbage")
    with pytest.raises(ValidationFailed):
        audit_list(limit=500)


@pytest.mark.django_db
def test_overlong_fields_are_clipped_before_hashing() -> None:
    audit_append(
        event_type="test." + "e" * 100,
        actor=Actor("agent", "i" * 100, "l" * 300),
        resource="kind/" + "n" * 400,
        request_id="r\x00" * 300,
    )
    event = AuditEvent.objects.get()
    assert len(event.resource) == 320 and len(event.actor_label) == 200
    assert verify_chain().ok


@pytest.mark.django_db
def test_a_batch_append_chains_in_order_between_single_appends() -> None:
    _append(2)
    batch = audit_append_many(
        [
            {
                "event_type": "action.expired",
                "actor": Actor.system("housekeeping"),
                "resource": f"dns-record/r{index}",
                "details": {"index": index},
            }
            for index in range(5)
        ]
    )
    assert [e.seq for e in batch] == [3, 4, 5, 6, 7]
    _append(1)
    batch = list(AuditEvent.objects.filter(seq__in=[e.seq for e in batch]).order_by("seq"))
    assert batch[0].prev_hash == AuditEvent.objects.get(seq=2).hash
    assert AuditEvent.objects.get(seq=8).prev_hash == batch[-1].hash
    assert audit_append_many([]) == []
    result = verify_chain()
    assert result.ok and result.events == 8


@pytest.mark.django_db
def test_a_batch_longer_than_one_statement_s_chunk_chains_across_its_chunks() -> None:
    """A batch goes to PostgreSQL in chunks, each one statement chained after the head the
    chunk before it moved: every event, with the odd fields (no run, a null action,
    non-ASCII details), hashes as a single append would."""
    _append(1)
    batch = audit_append_many(
        [
            {
                "event_type": "action.expired",
                "actor": Actor.person(SimpleNamespace(pk=7, get_username=lambda: "zoë")),
                "resource": f"dns-record/r{index}",
                "details": {"index": index, "note": "ünïcode ✓", "nested": {"n": [index]}},
            }
            for index in range(150)
        ]
    )
    assert [e.seq for e in batch] == list(range(2, 152))
    audit_link()
    batch = list(AuditEvent.objects.filter(seq__gte=2).order_by("seq"))
    for before, after in itertools.pairwise(batch):
        assert after.prev_hash == before.hash
    stored = {e.seq: e.hash for e in AuditEvent.objects.filter(seq__gte=2)}
    assert stored == {e.seq: e.hash for e in batch}
    result = verify_chain()
    assert result.ok and result.events == 151


@pytest.mark.django_db
def test_the_event_hash_is_unique_and_appends_update_no_index_nobody_reads() -> None:
    """Each append updates every index of the event table: no LIKE (varchar_pattern_ops)
    index on the hash, which no query uses; the hash stays unique."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'audit_auditevent' "
            "AND indexdef LIKE %s",
            ["%pattern_ops%"],
        )
        assert cursor.fetchall() == []
    (event,) = _append(1)
    twin = AuditEvent(
        seq=event.seq + 1000,
        created_at=event.created_at,
        actor_type=event.actor_type,
        event_type=event.event_type,
        prev_hash=event.hash,
        hash=event.hash,
    )
    with pytest.raises(DatabaseError), transaction.atomic():
        twin.save(force_insert=True)


_PLAIN_DETAILS: list[dict[str, Any]] = [
    {},
    {"operation": "update", "operation_id": 12, "fence": 33, "from_version": None},
    {"executor": {"type": "system", "id": "", "label": "worker"}, "ok": True, "n": -(2**70)},
    {"api_key": "x", "nested": {"Password": ["a"], "list": [{"secret_thing": 1}, [None]]}},
    {"note": "called with ak_abcdefghijkl and rt_1234567890", "t": "pt_short"},
    {"nul": "a\x00b", "lone": "x\udcff", "ünï": "çödé ✓", "bad\x00key": "v"},
]
_ODD_DETAILS: list[dict[Any, Any]] = [
    {"float": 0.1, "big": 1e16},
    {"tuple": (1, 2)},
    {3: "int key"},
    {"uuid": uuid.UUID(int=7), "when": timezone.now()},
]


@pytest.mark.parametrize("details", _PLAIN_DETAILS + _ODD_DETAILS)
def test_the_one_pass_cleaning_of_details_equals_the_json_round_trip(
    details: dict[str, Any],
) -> None:
    """Plain details skip the JSON round trip (audit.details._clean_plain); what the hash
    covers must be byte for byte what the round trip gives, and anything else (floats,
    tuples, non-str keys, objects) must still take the round trip."""
    scrubbed = details_rules._scrub(details)
    round_trip = details_rules.storable(json.loads(json.dumps(scrubbed, default=str)))
    cleaned = details_rules.clean_details(details)
    assert json.dumps(cleaned, sort_keys=True) == json.dumps(round_trip, sort_keys=True)
    if details in _PLAIN_DETAILS:
        assert details_rules._clean_plain(details) == round_trip
    else:
        with pytest.raises(details_rules._NotPlain):
            details_rules._clean_plain(details)


@pytest.mark.django_db
def test_a_guarded_append_appends_only_while_its_guard_holds() -> None:
    """audit_append_if: the statement a caller sends behind its own write (land.py); a
    guard that does not hold appends nothing and leaves the head unlocked and unmoved."""
    actor = Actor.system("test")
    with transaction.atomic():
        skipped = audit_append_if("1 = %s", [2], event_type="test.skipped", actor=actor)
        kept = audit_append_if("1 = %s", [1], event_type="test.kept", actor=actor)
        assert skipped is not None and kept is not None
        with connection.cursor() as cursor:
            cursor.execute(skipped.sql, skipped.params)
            assert skipped.appended(cursor.fetchone()) is None
            cursor.execute(kept.sql, kept.params)
            event = kept.appended(cursor.fetchone())
    assert event is not None and event.seq == 1
    assert list(AuditEvent.objects.values_list("event_type", flat=True)) == ["test.kept"]
    assert verify_chain().ok
    # Inside audit_deferred an append is not one statement: the caller appends itself.
    with transaction.atomic(), audit_deferred():
        assert audit_append_if("true", [], event_type="test.none", actor=actor) is None
