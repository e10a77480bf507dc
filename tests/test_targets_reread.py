"""The periodic re-read (issue 39): a write whose last read could not read the target ended
`failed` with its outcome unknown. The cron process reads it again later (nothing is sent):

- the target still unreachable → unchanged, read again only after a backoff;
- our document under a new version → `applied`, once, the trail saying it was settled later,
  its undo window starting then;
- still the version it was written on → not applied: `failed` with the read's evidence;
- someone else's version → said on the action (`last_read: conflict`), no new work;
- the resource's lock held (a write or an undo sending) → skipped this tick, nothing read or
  recorded and no backoff spent; settled on the next tick once the lock is free;
- the re-read paused past its lock's TTL between its read and its record while another write
  takes the lock, lands and is recorded → what it read is recorded on the lost attempt (true
  of it), but the mirror keeps the newer write (the fence checked at the mirror row).

A real PostgreSQL table behind a TCP link the test breaks (tests/fixtures/flaky_link.py), and
the Procfile's `cron` process with a real worker for the end-to-end case.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rq.cron import CronScheduler

from approvals.jobs import reread_job
from approvals.models import Action, Operation
from approvals.outbox import engine_redis as engine_redis_client
from approvals.services.execution import action_execute
from approvals.services.reread import RESULTS, reread_unsettled
from approvals.services.undo import action_undo_request, undo_execute
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.lock import FencedLock, lock_key
from ownership.models import Conflict, Resource
from tests.conftest import ROOT, subprocess_env
from tests.fixtures.engine import wait_for, wait_until_due
from tests.fixtures.last_read import Rows, events, propose_seats
from tests.fixtures.targets import row, someone_updates_row
from tests.races import WAIT, Worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

NOTHING = dict.fromkeys(RESULTS, 0)


def _unsettled(engine_world: Any, settings: Any, rows: Rows, *, landed: bool) -> Action:
    """One attempt allowed: its UPDATE sent and the answer lost (landed or not), then the
    target unreachable for the last read: `failed`, outcome unknown, last read unsettled."""
    settings.AIRLOCK_MAX_ATTEMPTS = 1
    settings.AIRLOCK_BACKOFF_BASE_SECONDS = 0.05
    settings.AIRLOCK_REREAD_EVERY_SECONDS = 1
    link = rows.link
    assert link is not None
    action = propose_seats(engine_world, rows.kind)
    link.cut_next(b"UPDATE", deliver=landed)
    assert action_execute(action_id=action.pk) == "unknown"
    link.down()
    wait_until_due(action)
    assert action_execute(action_id=action.pk) == "failed"
    action.refresh_from_db()
    assert action.error["outcome"] == "unknown" and action.error["last_read"] == "unsettled"
    assert Operation.objects.filter(action=action, status="unknown").count() == 1
    return action


def _trail(action: Action) -> list[str]:
    return list(
        AuditEvent.objects.filter(action_id=action.pk)
        .order_by("seq")
        .values_list("event_type", flat=True)
    )


def _after_backoff(operation: Operation) -> None:
    operation.refresh_from_db()
    time.sleep(max(0.0, operation.outcome["reread"]["next"] - time.time()) + 0.05)


def test_a_write_left_unknown_is_recorded_applied_once_when_the_target_answers_again(
    engine_world: Any, engine_redis: Any, settings: Any, linked_rows: Rows
) -> None:
    action = _unsettled(engine_world, settings, linked_rows, landed=True)
    assert linked_rows.link is not None
    lost = Operation.objects.get(action=action, status="unknown")
    trail_before = _trail(action)
    error_before = dict(action.error)

    # Still unreachable: nothing changes but when it is read next.
    assert reread_unsettled() == {**NOTHING, "unreadable": 1}
    action.refresh_from_db()
    lost.refresh_from_db()
    assert (action.status, action.error) == ("failed", error_before)
    assert lost.status == "unknown" and lost.outcome["reread"]["count"] == 1
    assert _trail(action) == trail_before  # no audit row per failed read
    assert reread_unsettled() == NOTHING  # backing off: not hammered

    linked_rows.link.up()
    _after_backoff(lost)
    before = timezone.now()
    assert reread_unsettled() == {**NOTHING, "applied": 1}
    action.refresh_from_db()
    lost.refresh_from_db()
    assert action.status == "applied" and action.error is None
    assert row(linked_rows.url, "acme") == ({"seats": 9}, 2)  # the one UPDATE; nothing sent
    assert lost.status == "done" and lost.result_version == "2"
    assert lost.outcome["settled_later"] is True and lost.outcome["settled_by_reading"] is True
    assert lost.outcome["reread"]["result"] == "applied"
    assert lost.undo_deadline is not None and lost.undo_deadline > before  # starts now
    assert Resource.objects.get(kind=linked_rows.kind, name="acme").token == "2"
    [applied] = events(action, "write.applied")
    assert applied["settled_later"] is True and applied["to_version"] == "2"
    assert applied["failed_error"]["last_read"] == "unsettled"
    assert AuditEvent.objects.get(
        action_id=action.pk, event_type="write.applied"
    ).actor_label.endswith("reread")
    tail = ["action.last_read_scheduled", "action.failed", "write.applied"]
    assert [e for e in _trail(action) if e in tail] == tail

    # Once: another tick finds nothing; and the record is true, so undo restores.
    assert reread_unsettled() == NOTHING
    assert len(events(action, "write.applied")) == 1
    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
    assert undo_execute(undo_operation_id=undo.pk) == "undone"
    assert row(linked_rows.url, "acme") == ({"seats": 5}, 3)


@pytest.mark.parametrize("case", ["not_applied", "conflict"])
def test_a_write_left_unknown_that_did_not_land_is_recorded_with_the_read_s_evidence(
    engine_world: Any, engine_redis: Any, settings: Any, linked_rows: Rows, case: str
) -> None:
    action = _unsettled(engine_world, settings, linked_rows, landed=False)
    assert linked_rows.link is not None
    lost = Operation.objects.get(action=action, status="unknown")
    linked_rows.link.up()
    if case == "conflict":
        someone_updates_row(linked_rows.url, "acme", {"seats": 7})  # version 2, not ours

    assert reread_unsettled() == {**NOTHING, case: 1}
    action.refresh_from_db()
    lost.refresh_from_db()
    assert action.status == "failed"
    assert action.error["code"] == "attempts_exhausted"
    assert action.error["last_read"] == case
    assert action.error["current_version"] == ("1" if case == "not_applied" else "2")
    assert action.error["settled_later"]
    [reread] = events(action, "action.reread")
    assert reread["result"] == case and reread["operation_id"] == lost.pk
    assert not events(action, "write.applied")
    if case == "not_applied":
        assert "outcome" not in action.error  # no longer unknown: the read is the evidence
        assert lost.status == "failed" and lost.outcome["settled"] == "not_applied"
        assert row(linked_rows.url, "acme") == ({"seats": 5}, 1)
    else:
        assert action.error["outcome"] == "unknown"  # ours may have landed before theirs
        assert lost.status == "unknown" and lost.outcome["reread"]["result"] == "conflict"
        assert row(linked_rows.url, "acme") == ({"seats": 7}, 2)  # theirs, untouched
        assert Resource.objects.get(kind=linked_rows.kind, name="acme").token == "2"
        assert not Conflict.objects.filter(action=action).exists()  # no new work
    assert reread_unsettled() == NOTHING  # settled: never read again


def test_a_write_that_ended_long_ago_is_left_to_a_person(
    engine_world: Any, engine_redis: Any, settings: Any, linked_rows: Rows
) -> None:
    action = _unsettled(engine_world, settings, linked_rows, landed=True)
    assert linked_rows.link is not None
    linked_rows.link.up()
    later = timezone.now() + timedelta(hours=settings.AIRLOCK_REREAD_MAX_AGE_HOURS, minutes=1)
    assert reread_unsettled(now=later) == NOTHING
    assert Action.objects.get(pk=action.pk).status == "failed"


def test_the_cron_schedules_the_re_read(redis_client: Any) -> None:
    scheduler = CronScheduler(connection=redis_client)
    scheduler.load_config_from_file("approvals.cron")
    assert reread_job in {job.func for job in scheduler.get_jobs()}


def test_the_procfile_cron_and_a_real_worker_settle_a_write_left_unknown(
    engine_world: Any,
    engine_redis: Any,
    settings: Any,
    linked_rows: Rows,
    rq_worker: Any,
    tmp_path: Any,
) -> None:
    """End to end: the write left unknown in this process; the Procfile's `cron` line
    (`rqcron approvals.cron`, the re-read every second here) and a real worker settle it once
    the target is reachable again."""
    action = _unsettled(engine_world, settings, linked_rows, landed=True)
    assert linked_rows.link is not None
    linked_rows.link.up()
    env = {"AIRLOCK_REREAD_EVERY_SECONDS": "1"}
    worker = rq_worker(**env)
    log = (tmp_path / "cron.log").open("wb")
    cron = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "rqcron", "approvals.cron"],
        env=subprocess_env(REDIS_URL=engine_redis.url, **env),
        cwd=str(ROOT),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: Action.objects.get(pk=action.pk).status != "failed", timeout=60)
    finally:
        cron.terminate()
        cron.wait(timeout=10)
        log.close()
    action.refresh_from_db()
    assert action.status == "applied", worker.output()
    assert row(linked_rows.url, "acme") == ({"seats": 9}, 2)
    assert len(events(action, "write.applied")) == 1


def _unsettled_undo(engine_world: Any, settings: Any, rows: Rows) -> Operation:
    """acme written to {"seats": 9}, then its undo's only send lands and its answer is lost,
    and the target is unreachable for the undo's last read: `failed`, `last_read: unsettled`."""
    settings.AIRLOCK_MAX_ATTEMPTS = 1
    settings.AIRLOCK_BACKOFF_BASE_SECONDS = 0.05
    link = rows.link
    assert link is not None
    action = propose_seats(engine_world, rows.kind)
    assert action_execute(action_id=action.pk) == "applied"
    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
    link.cut_next(b"UPDATE", deliver=True)
    assert undo_execute(undo_operation_id=undo.pk) == "last_read"
    link.down()
    assert undo_execute(undo_operation_id=undo.pk) == "failed"
    undo.refresh_from_db()
    assert undo.outcome["last_read"] == "unsettled"
    assert row(rows.url, "acme") == ({"seats": 5}, 3)  # it did land
    return undo


@pytest.mark.parametrize("what", ["write", "undo"])
def test_the_re_read_skips_a_resource_whose_lock_is_held_and_settles_it_on_the_next_tick(
    engine_world: Any, engine_redis: Any, settings: Any, linked_rows: Rows, what: str
) -> None:
    """A write (or an undo) of the resource holds its lock while it sends: the re-read does
    not read or record under it — it would record what it read before that write landed."""
    if what == "write":
        action = _unsettled(engine_world, settings, linked_rows, landed=True)
        unsettled = Operation.objects.get(action=action, status="unknown")
    else:
        unsettled = _unsettled_undo(engine_world, settings, linked_rows)
        action = unsettled.action
    assert linked_rows.link is not None
    linked_rows.link.up()
    trail_before = _trail(action)
    writer = FencedLock(
        engine_redis_client(),
        key=action.resource_identifier,
        ttl_ms=60_000,
        holder="a-concurrent-write",
    )
    writer.acquire()
    try:
        for _ in range(2):  # held: skipped each tick, at once (no wait for the holder)
            started = time.monotonic()
            assert reread_unsettled() == {**NOTHING, "busy": 1}
            assert time.monotonic() - started < 5  # far below the holder's 60 s TTL
        action.refresh_from_db()
        unsettled.refresh_from_db()
        assert action.status == ("failed" if what == "write" else "applied")
        assert unsettled.status == ("unknown" if what == "write" else "failed")
        assert "reread" not in unsettled.outcome  # no backoff spent: read on the next tick
        assert _trail(action) == trail_before
        assert writer.held()  # the re-read never took or released it
    finally:
        writer.release()

    assert reread_unsettled() == {**NOTHING, "applied": 1}
    action.refresh_from_db()
    unsettled.refresh_from_db()
    assert action.status == ("applied" if what == "write" else "undone")
    assert unsettled.status == "done" and unsettled.outcome["settled_later"] is True
    assert reread_unsettled() == NOTHING


@pytest.mark.parametrize("what", ["write", "undo"])
def test_a_re_read_paused_past_its_lock_s_ttl_never_puts_the_mirror_behind_a_newer_write(
    engine_world: Any,
    engine_redis: Any,
    settings: Any,
    linked_rows: Rows,
    monkeypatch: pytest.MonkeyPatch,
    what: str,
) -> None:
    """The collision: the re-read reads the target and checks its lock, then its process
    pauses (GC, SIGSTOP) past the lock's TTL before it records. Another write of the same
    resource takes the lock with a newer fence, lands at the target and records the mirror.
    The re-read resumes and records: the mirror must still show the newer write, never what
    the re-read saw before it (the mirror behind the target: a conflict page, an undo or a
    proposal's diff against a document that is gone)."""
    from approvals.services import external_undo, reread

    if what == "write":
        action = _unsettled(engine_world, settings, linked_rows, landed=False)  # acme at 1
        record_module, record_name, written_on = reread, "_record_not_done", "1"
    else:
        action = _unsettled_undo(engine_world, settings, linked_rows).action  # acme at 3
        record_module, record_name, written_on = external_undo, "_record_undone", "3"
    assert linked_rows.link is not None
    linked_rows.link.up()
    paused, resume = threading.Event(), threading.Event()
    real_record = getattr(record_module, record_name)

    def record_after_a_pause(*args: Any, **kwargs: Any) -> Any:
        paused.set()  # read, and the lock checked: still ours
        assert resume.wait(WAIT)
        return real_record(*args, **kwargs)

    monkeypatch.setattr(record_module, record_name, record_after_a_pause)
    rereader = Worker(reread_unsettled)
    rereader.start()
    assert paused.wait(WAIT)
    # Paused past the TTL: the lock is gone (its heartbeat paused with the process).
    engine_redis_client().delete(lock_key(action.resource_identifier))
    newer = engine_world.propose(
        linked_rows.kind,
        "acme",
        payload={"seats": 7},
        payload_format="merge_patch",
        observed_version=written_on,
    )
    assert action_execute(action_id=newer.pk) == "applied"  # a newer fence, at the target
    landed = str(int(written_on) + 1)
    assert row(linked_rows.url, "acme") == ({"seats": 7}, int(landed))
    resume.set()
    counts = rereader.finish()

    mirror = Resource.objects.get(kind=linked_rows.kind, name="acme")
    assert (mirror.token, mirror.document) == (landed, {"seats": 7})  # not put back
    assert row(linked_rows.url, "acme") == ({"seats": 7}, int(landed))  # nothing sent
    action.refresh_from_db()
    if what == "write":
        # What it read is true of the lost attempt: it had not landed (acme was still at 1).
        assert counts == {**NOTHING, "not_applied": 1}
        assert action.status == "failed" and action.error["last_read"] == "not_applied"
        assert action.error["current_version"] == "1"
    else:
        # The undo had landed (acme at 3 held the prior document): recorded undone, once.
        assert counts == {**NOTHING, "applied": 1}
        assert action.status == "undone"
        assert len(events(action, "write.undone")) == 1
    assert reread_unsettled() == NOTHING  # settled once: never read again
