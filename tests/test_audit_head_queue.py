"""The audit head's queue: every statement that locks the head first takes one advisory
lock (audit/services.py HEAD_QUEUE_LOCK), so appenders wait in PostgreSQL's lock queue
instead of on the row; the row lock still keeps the chain whole. Collisions forced with an
append held open in another transaction."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from django.db import connection, transaction

from audit.chain import GENESIS_HASH
from audit.models import AuditEvent, AuditHead
from audit.services import (
    HEAD_QUEUE_LOCK,
    Actor,
    audit_append,
    audit_append_if,
    audit_append_many,
    audit_deferred,
)
from audit.verify import verify_chain
from tests.races import WAIT, Holder, Worker, over_sessions, wait_for_lock_waiters

ACTOR = Actor.system("test")


def _append(event_type: str) -> int:
    return audit_append(event_type=event_type, actor=ACTOR).seq


def _batch(event_type: str) -> list[int]:
    events = audit_append_many([{"event_type": event_type, "actor": ACTOR}] * 3)
    return [event.seq for event in events]


def _waiting_on(wait_event: str) -> int:
    return over_sessions(
        "count(*)", where=f"wait_event_type = 'Lock' AND wait_event = '{wait_event}'"
    )


def _own_queue_locks() -> int:
    """How many times this session holds the head's queue lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'"
            " AND classid = %s AND objid = %s AND objsubid = 2",
            list(HEAD_QUEUE_LOCK),
        )
        return int(cursor.fetchone()[0])


def _head_free_elsewhere() -> tuple[bool, bool]:
    """From another session, without waiting: (is the queue free, is the head row free)."""

    def probe() -> tuple[bool, bool]:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", list(HEAD_QUEUE_LOCK))
            queue_free = bool(cursor.fetchone()[0])
            cursor.execute(
                "SELECT count(*) FROM (SELECT FROM audit_audithead WHERE id = 1"
                " FOR UPDATE SKIP LOCKED) AS free"
            )
            row_free = cursor.fetchone()[0] == 1
        return queue_free, row_free

    worker = Worker(probe)
    worker.start()
    result: tuple[bool, bool] = worker.finish()
    return result


@pytest.fixture(autouse=True)
def _head_row(transactional_db: None) -> None:
    """The head row, which a transactional test's flush removes (appends recreate it, but
    only after a first attempt that takes no lock)."""
    AuditHead.objects.get_or_create(pk=1, defaults={"seq": 0, "hash": GENESIS_HASH})


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("second", "seqs"), [(_append, 2), (_batch, [2, 3, 4])], ids=["single", "batch"]
)
def test_a_second_appender_waits_in_the_queue_not_on_the_row_until_the_first_commits(
    second: Callable[[str], object], seqs: object
) -> None:
    first = Holder(lambda: _append("test.first")).hold()
    waiting = Worker(lambda: second("test.second"))
    waiting.start()
    wait_for_lock_waiters(1, threads=(waiting,))
    # It waits on the queue's advisory lock: not on the head row (a tuple or the holder's
    # transaction), where every waiter would wake at each commit.
    assert _waiting_on("advisory") == 1
    assert _waiting_on("tuple") == _waiting_on("transactionid") == 0
    assert first.release() == 1
    assert waiting.finish() == seqs
    assert list(AuditEvent.objects.order_by("seq").values_list("event_type", flat=True))[:2] == [
        "test.first",
        "test.second",
    ]
    assert verify_chain().ok


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_holder_lets_the_queue_through_without_a_gap() -> None:
    ready, go = threading.Event(), threading.Event()

    def append_then_roll_back() -> None:
        with transaction.atomic():
            _append("test.rolled-back")
            ready.set()
            assert go.wait(WAIT), "never released"
            transaction.set_rollback(True)

    holder = Worker(append_then_roll_back)
    holder.start()
    assert ready.wait(WAIT)
    waiting = Worker(lambda: _append("test.kept"))
    waiting.start()
    wait_for_lock_waiters(1, threads=(waiting,))
    assert _waiting_on("advisory") == 1
    go.set()
    holder.finish()
    assert waiting.finish() == 1
    assert list(AuditEvent.objects.values_list("seq", "event_type")) == [(1, "test.kept")]
    assert verify_chain().ok


@pytest.mark.django_db(transaction=True)
def test_a_guarded_append_takes_the_queue_and_the_row_only_when_its_guard_holds() -> None:
    with transaction.atomic():
        skipped = audit_append_if("1 = %s", [2], event_type="test.skipped", actor=ACTOR)
        assert skipped is not None
        with connection.cursor() as cursor:
            cursor.execute(skipped.sql, skipped.params)
            assert skipped.appended(cursor.fetchone()) is None
        assert _own_queue_locks() == 0
        assert _head_free_elsewhere() == (True, True)
        kept = audit_append_if("1 = %s", [1], event_type="test.kept", actor=ACTOR)
        assert kept is not None
        with connection.cursor() as cursor:
            cursor.execute(kept.sql, kept.params)
            assert kept.appended(cursor.fetchone()) is not None
        assert _own_queue_locks() == 1
        assert _head_free_elsewhere() == (False, False)
    assert _head_free_elsewhere() == (True, True)  # both end with the transaction
    assert verify_chain().ok


@pytest.mark.django_db(transaction=True)
def test_a_deferred_batch_takes_the_queue_at_its_end_only() -> None:
    with transaction.atomic(), audit_deferred():
        audit_append(event_type="test.deferred", actor=ACTOR)
        assert _own_queue_locks() == 0  # held back: nothing locked yet
    with transaction.atomic():
        with audit_deferred():
            audit_append(event_type="test.deferred", actor=ACTOR)
        assert _own_queue_locks() == 1
    assert AuditEvent.objects.count() == 2
    assert verify_chain().ok


@pytest.mark.django_db(transaction=True)
def test_a_deferred_block_inside_another_joins_it_and_a_failed_one_drops_its_events() -> None:
    with transaction.atomic(), audit_deferred():
        audit_append(event_type="test.outer.first", actor=ACTOR)
        with audit_deferred():
            audit_append(event_type="test.inner", actor=ACTOR)
        assert _own_queue_locks() == 0  # the inner block's end appended nothing yet
        with pytest.raises(RuntimeError), transaction.atomic(), audit_deferred():
            audit_append(event_type="test.rolled_back", actor=ACTOR)
            raise RuntimeError("its savepoint rolls back, and its event with it")
        audit_append(event_type="test.outer.last", actor=ACTOR)
        assert _own_queue_locks() == 0
    appended = AuditEvent.objects.filter(event_type__startswith="test.").order_by("seq")
    assert list(appended.values_list("event_type", flat=True)) == [
        "test.outer.first",
        "test.inner",
        "test.outer.last",
    ]
    assert verify_chain().ok
