"""Events commit unlinked and the linker chains them (audit/linker.py).

The collisions are forced with appends held open in other transactions: an append waits for
no other; the linker never links past a transaction that may still commit an event with a
lower seq, and links it in seq order once it has; a rolled-back append leaves a hole in the
numbers, not a break in the chain; two linkers at once never fork it; the trigger lets the
linker fill an event's link and nothing else. Then the Procfile's `audit` process itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction
from django.test import override_settings

from audit.chain import GENESIS_HASH
from audit.linker import audit_link, audit_unlinked
from audit.models import AuditEvent, AuditHead
from audit.services import (
    Actor,
    audit_append,
    audit_append_if,
    audit_chain_status,
    audit_deferred,
)
from audit.verify import verify_chain
from tests.conftest import ROOT, subprocess_env
from tests.races import WAIT, Holder, Worker, over_sessions

ACTOR = Actor.system("test")


def _append(event_type: str) -> int:
    return audit_append(event_type=event_type, actor=ACTOR).seq


def _linked() -> list[tuple[int, str]]:
    """(seq, event type) of the linked events, in chain order."""
    head = AuditHead.objects.get(pk=1).seq
    rows = AuditEvent.objects.filter(seq__lte=head).exclude(hash="").order_by("seq")
    return list(rows.values_list("seq", "event_type"))


@pytest.fixture(autouse=True)
def _head_row(transactional_db: None) -> None:
    """The head row, which a transactional test's flush removes."""
    AuditHead.objects.get_or_create(pk=1, defaults={"seq": 0, "hash": GENESIS_HASH})


def test_an_append_waits_for_no_other_open_append() -> None:
    first = Holder(lambda: _append("test.first")).hold()
    second = Worker(lambda: _append("test.second"))
    second.start()
    # It commits while the first is still open: no lock queue any more.
    assert second.finish() > 0
    assert over_sessions("count(*)", where="wait_event_type = 'Lock'") == 0
    first.release()
    assert audit_link().linked == 2
    assert verify_chain().ok


def test_the_linker_waits_for_an_open_append_with_a_lower_seq_then_links_in_seq_order() -> None:
    held = Holder(lambda: _append("test.held")).hold()  # draws the lower seq, stays open
    later = _append("test.committed")  # a higher seq, committed first
    passed = audit_link(wait_seconds=0.2)
    # Linking `later` now would put `held` behind it (or lose it): nothing is linked.
    assert passed.linked == 0 and passed.held_back
    assert _linked() == []
    assert AuditEvent.objects.get(seq=later).hash == ""
    lower = held.release()
    assert lower < later
    assert audit_link().linked == 2
    assert _linked() == [(lower, "test.held"), (later, "test.committed")]
    result = verify_chain()
    assert result.ok and result.events == later


def test_the_linker_waits_for_an_open_append_whose_transaction_id_no_ended_one_passed() -> None:
    """The collision `make bench` found (a broken link after the decision round trips): an
    open append's transaction id can be newer than every transaction that has *ended* — a
    snapshot's xmax is one past the newest ended id, and ids at or above it are in progress
    without being listed in the snapshot. Here the committed event's transaction took its
    id first and drew its seq last; the held one took its id after it and drew the lower
    seq. No pass may link the higher seq while the lower one can still commit."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_xact_id()")  # the older transaction id
        held = Holder(lambda: _append("test.held")).hold()  # a newer id, the lower seq
        later = _append("test.committed")  # the higher seq, committed first (older id)
    for wait in (0.05, 0.2):  # a reader's short pass, and the linker's by lock
        passed = audit_link(wait_seconds=wait)
        assert passed.linked == 0 and passed.held_back, wait
    assert _linked() == []
    lower = held.release()
    assert lower < later
    assert audit_link().linked == 2
    assert _linked() == [(lower, "test.held"), (later, "test.committed")]
    assert verify_chain().ok


def test_a_transaction_open_elsewhere_holds_back_a_short_pass_but_not_the_linker_s() -> None:
    def unrelated_write() -> int:
        with connection.cursor() as cursor:  # a transaction id, no audit event
            cursor.execute("SELECT pg_current_xact_id()::text::bigint")
            return int(cursor.fetchone()[0])

    elsewhere = Holder(unrelated_write).hold()
    seq = _append("test.committed")
    # A reader's short pass waits by transaction id only: the open one may hold a seq.
    assert audit_link(wait_seconds=0.05).linked == 0
    # The linker's pass looks by lock past it: it never wrote an event.
    passed = audit_link(wait_seconds=0.5)
    assert passed.linked == 1 and passed.head_seq == seq
    elsewhere.release()
    assert verify_chain().ok


def test_a_transaction_open_in_another_database_holds_back_no_pass() -> None:
    """A write transaction of another database on the same server (a governed table, another
    application) cannot hold this database's seq: even a reader's short pass links past it.
    (Before, every verification, badge and export linked nothing while one was open.)"""
    settings = connection.settings_dict
    other = psycopg.connect(
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        dbname="postgres",
    )
    try:
        other.execute("SELECT pg_current_xact_id()")  # open, with a transaction id
        seq = _append("test.committed")
        passed = audit_link(wait_seconds=0.05)
        assert passed.linked == 1 and passed.head_seq == seq
    finally:
        other.rollback()
        other.close()
    assert verify_chain().ok


def test_a_rolled_back_append_leaves_a_hole_in_the_numbers_not_a_break_in_the_chain() -> None:
    ready, go = threading.Event(), threading.Event()

    def append_then_roll_back() -> int:
        with transaction.atomic():
            seq = _append("test.rolled-back")
            ready.set()
            assert go.wait(WAIT), "never released"
            transaction.set_rollback(True)
        return seq

    holder = Worker(append_then_roll_back)
    holder.start()
    assert ready.wait(WAIT)
    kept = _append("test.kept")
    go.set()
    hole = holder.finish()
    assert hole < kept
    assert audit_link().linked == 1
    assert _linked() == [(kept, "test.kept")]
    assert not AuditEvent.objects.filter(seq=hole).exists()
    assert verify_chain().ok


def test_a_guarded_append_appends_and_draws_a_seq_only_when_its_guard_holds() -> None:
    with transaction.atomic():
        skipped = audit_append_if("1 = %s", [2], event_type="test.skipped", actor=ACTOR)
        assert skipped is not None
        with connection.cursor() as cursor:
            cursor.execute(skipped.sql, skipped.params)
            assert skipped.appended(cursor.fetchone()) is None
        kept = audit_append_if("1 = %s", [1], event_type="test.kept", actor=ACTOR)
        assert kept is not None
        with connection.cursor() as cursor:
            cursor.execute(kept.sql, kept.params)
            event = kept.appended(cursor.fetchone())
    assert event is not None
    assert list(AuditEvent.objects.values_list("seq", "event_type")) == [(event.seq, "test.kept")]
    audit_link()
    assert verify_chain().ok


def test_a_deferred_block_inside_another_joins_it_and_a_failed_one_drops_its_events() -> None:
    with transaction.atomic(), audit_deferred():
        audit_append(event_type="test.outer.first", actor=ACTOR)
        with audit_deferred():
            audit_append(event_type="test.inner", actor=ACTOR)
        assert not AuditEvent.objects.exists()  # held back until the outer block ends
        with pytest.raises(RuntimeError), transaction.atomic(), audit_deferred():
            audit_append(event_type="test.rolled_back", actor=ACTOR)
            raise RuntimeError("its savepoint rolls back, and its event with it")
        audit_append(event_type="test.outer.last", actor=ACTOR)
    audit_link()
    assert [kind for _, kind in _linked()] == ["test.outer.first", "test.inner", "test.outer.last"]
    assert verify_chain().ok


def test_many_writers_and_two_linkers_at_once_never_fork_the_chain() -> None:
    writers, each = 6, 25
    stop = threading.Event()

    def write(n: int) -> list[int]:
        return [_append(f"test.writer{n}") for _ in range(each)]

    def link() -> int:
        linked = 0
        while not stop.is_set():
            linked += audit_link(wait_seconds=0.05).linked
        return linked

    linkers = [Worker(link) for _ in range(2)]
    for linker in linkers:
        linker.start()
    threads = [Worker(lambda n=n: write(n)) for n in range(writers)]
    for thread in threads:
        thread.start()
    seqs = sorted(seq for thread in threads for seq in thread.finish())
    stop.set()
    linked_by_linkers = sum(linker.finish() for linker in linkers)
    linked_after = audit_link().linked
    # Every committed event linked exactly once, in seq order, one chain.
    assert linked_by_linkers + linked_after == writers * each
    assert [seq for seq, _ in _linked()] == seqs
    result = verify_chain()
    assert result.ok and result.events == seqs[-1]
    assert audit_unlinked().oldest is None


def test_the_trigger_lets_the_linker_fill_a_link_and_nothing_else() -> None:
    seq = _append("test.event")
    audit_link()
    stored = AuditEvent.objects.get(seq=seq)
    unlinked = _append("test.unlinked")

    def refused(statement: str, params: list[object]) -> bool:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                # The suite's connection may switch the trigger off (its table flushes).
                cursor.execute("SET LOCAL airlock.audit_maintenance = 'off'")
                cursor.execute(statement, params)
        except DatabaseError as exc:
            return "append-only" in str(exc)
        return False

    assert refused("UPDATE audit_auditevent SET hash = %s WHERE seq = %s", ["f" * 64, seq])
    assert refused(
        "UPDATE audit_auditevent SET hash = %s, prev_hash = %s, event_type = 'forged' "
        "WHERE seq = %s",
        ["f" * 64, stored.hash, unlinked],
    )
    assert refused("DELETE FROM audit_auditevent WHERE seq = %s", [unlinked])
    assert AuditEvent.objects.get(seq=seq).hash == stored.hash
    assert audit_link().linked == 1
    assert verify_chain().ok


@pytest.fixture
def tight_bound() -> Iterator[None]:
    with override_settings(AIRLOCK_AUDIT_LINK_BOUND_SECONDS=1):
        yield


@pytest.mark.usefixtures("tight_bound")
def test_verification_says_the_chain_is_behind_while_an_old_transaction_holds_the_linking() -> None:
    held = Holder(lambda: _append("test.held")).hold()
    committed = _append("test.committed")
    time.sleep(1.2)  # past the bound: what is measured is an age, so time must pass
    status = audit_chain_status(fresh=True)
    assert not status.ok
    assert "behind" in status.problem and status.behind_seconds > 1
    assert status.linked_seq < committed
    held.release()
    status = audit_chain_status(fresh=True)
    assert status.ok and status.linked_seq == committed and status.behind_seconds == 0


def test_the_procfile_audit_process_links_committed_events_and_stops_on_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "audit_link", "--forever"],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        seq = _append("test.linked-by-the-process")
        deadline = time.monotonic() + WAIT
        while AuditHead.objects.get(pk=1).seq < seq:
            assert time.monotonic() < deadline, "the audit process linked nothing"
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            time.sleep(0.05)
        assert verify_chain().ok
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=WAIT)[0].decode()
    assert process.returncode == 0, output
