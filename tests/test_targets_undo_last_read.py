"""The undo's last read (issue 39): an undo on an external target whose attempts run out after
a send that may have reached the target (its answer lost) is not failed blind. One last
delivery reads the target and sends nothing:

- the prior document under a new version → undone (once: the target's version moves once);
- still the version the write produced → `failed`, not done, with what the read saw — and it
  may be asked for again;
- the target cannot be read → `failed` with `outcome: unknown`, `last_read: unsettled`
  (the periodic re-read, tests/test_targets_reread.py, settles it later).

A real PostgreSQL table behind a TCP link the test breaks (tests/fixtures/flaky_link.py): the
undo's UPDATE reaches the server and its answer is swallowed, or it is dropped before.
"""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Action, Operation
from approvals.services.execution import action_execute
from approvals.services.reread import RESULTS, reread_unsettled
from approvals.services.undo import action_undo_request, undo_execute
from audit.services import Actor
from ownership.models import Conflict
from tests.fixtures.last_read import Rows, events, propose_seats
from tests.fixtures.targets import row, someone_updates_row

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _applied(engine_world: Any, rows: Rows) -> Action:
    """acme written to {"seats": 9} (version 2) through the link, recorded applied."""
    action = propose_seats(engine_world, rows.kind)
    assert action_execute(action_id=action.pk) == "applied"
    assert row(rows.url, "acme") == ({"seats": 9}, 2)
    return action


@pytest.mark.parametrize("case", ["restored", "not_restored", "unreadable", "moved"])
def test_an_undo_whose_only_send_lost_its_answer_is_settled_by_its_last_read(
    engine_world: Any, engine_redis: Any, settings: Any, linked_rows: Rows, case: str
) -> None:
    settings.AIRLOCK_MAX_ATTEMPTS = 1
    settings.AIRLOCK_BACKOFF_BASE_SECONDS = 0.05
    link = linked_rows.link
    assert link is not None
    action = _applied(engine_world, linked_rows)
    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))

    # The one delivery allowed: the conditional UPDATE back to {"seats": 5} is sent and its
    # answer lost — it reached the server (committed) or it never did.
    landed = case in ("restored", "unreadable")
    link.cut_next(b"UPDATE", deliver=landed)
    assert undo_execute(undo_operation_id=undo.pk) == "last_read"  # was: "failed"
    assert link.cuts_done == 1
    undo.refresh_from_db()
    assert undo.status == "pending"
    assert undo.outcome["last_read"] == "due" and undo.outcome["unknown"]
    assert undo.outcome["attempts"] == 1
    [scheduled] = events(action, "undo.last_read_scheduled")
    assert scheduled["undo_operation"] == undo.pk and scheduled["attempts"] == 1
    assert not events(action, "undo.failed")
    expected = ({"seats": 5}, 3) if landed else ({"seats": 9}, 2)
    assert row(linked_rows.url, "acme") == expected

    if case == "unreadable":
        link.down()
    if case == "moved":
        someone_updates_row(linked_rows.url, "acme", {"seats": 7})  # version 3, not ours
    outcome = undo_execute(undo_operation_id=undo.pk)  # the last read
    undo.refresh_from_db()
    action.refresh_from_db()
    original = Operation.objects.get(pk=undo.undo_of_id)

    if case == "restored":
        assert outcome == "undone"
        assert row(linked_rows.url, "acme") == ({"seats": 5}, 3)  # one UPDATE, not resent
        assert (undo.status, action.status, original.status) == ("done", "undone", "undone")
        assert undo.outcome["last_read"] is True and undo.result_version == "3"
        [undone] = events(action, "write.undone")
        assert undone["last_read"] is True and undone["to_version"] == "3"
        assert not events(action, "undo.failed")
    elif case == "not_restored":
        assert outcome == "failed"
        assert row(linked_rows.url, "acme") == ({"seats": 9}, 2)  # nothing sent by the read
        assert (undo.status, action.status, original.status) == ("failed", "applied", "done")
        assert undo.outcome["last_read"] == "not_applied"
        assert undo.outcome["current_version"] == "2"
        assert undo.outcome["retryable"] is True and "unknown" not in undo.outcome
        [failed] = events(action, "undo.failed")
        assert failed["last_read"] == "not_applied" and failed["current_version"] == "2"
        # Not done, with evidence: asked again, it is sent (the link is up) and lands once.
        again = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
        assert again.pk != undo.pk and "unknown" not in again.outcome
        assert undo_execute(undo_operation_id=again.pk) == "undone"
        assert row(linked_rows.url, "acme") == ({"seats": 5}, 3)
    elif case == "unreadable":
        assert outcome == "failed"
        assert row(linked_rows.url, "acme") == ({"seats": 5}, 3)  # restored — and
        # nothing on record says it was not: the outcome is unknown.
        assert (undo.status, action.status, original.status) == ("failed", "applied", "done")
        assert undo.outcome["outcome"] == "unknown"
        assert undo.outcome["last_read"] == "unsettled"
        assert undo.outcome["unknown"] and undo.outcome["retryable"] is True
        [failed] = events(action, "undo.failed")
        assert failed["outcome"] == "unknown" and failed["last_read"] == "unsettled"
        assert not events(action, "write.undone")
        # Asked again, the new undo inherits the mark: it reads before it sends, so the
        # restore that did land is recorded, not met as someone else's change.
        link.up()
        again = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
        assert again.outcome["unknown_from"] == undo.pk
        assert undo_execute(undo_operation_id=again.pk) == "undone"
        assert row(linked_rows.url, "acme") == ({"seats": 5}, 3)
        assert not Conflict.objects.filter(action=action).exists()
    else:  # someone else's version: the refusal and a conflict for a person
        assert outcome == "conflict"
        assert row(linked_rows.url, "acme") == ({"seats": 7}, 3)
        assert undo.status == "failed" and action.status == "applied"
        assert Conflict.objects.filter(action=action, origin="undo").count() == 1
        assert not events(action, "undo.failed")
    if case != "moved":
        assert not Conflict.objects.filter(action=action).exists()


def test_an_unsettled_undo_is_settled_by_the_periodic_re_read_once_the_target_answers(
    engine_world: Any, engine_redis: Any, settings: Any, linked_rows: Rows
) -> None:
    """The undo's answer lost and its last read unable to read: failed, unknown. The
    periodic re-read cannot read either (unchanged), then the target is back: undone, once,
    the trail saying it was settled later."""
    settings.AIRLOCK_MAX_ATTEMPTS = 1
    settings.AIRLOCK_BACKOFF_BASE_SECONDS = 0.05
    settings.AIRLOCK_REREAD_EVERY_SECONDS = 1
    link = linked_rows.link
    assert link is not None
    action = _applied(engine_world, linked_rows)
    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
    link.cut_next(b"UPDATE", deliver=True)
    assert undo_execute(undo_operation_id=undo.pk) == "last_read"
    link.down()
    assert undo_execute(undo_operation_id=undo.pk) == "failed"

    assert reread_unsettled()["unreadable"] == 1
    undo.refresh_from_db()
    assert undo.status == "failed" and undo.outcome["last_read"] == "unsettled"
    assert undo.outcome["reread"]["count"] == 1
    assert reread_unsettled()["unreadable"] == 0  # backing off: not read again at once

    link.up()
    wait = undo.outcome["reread"]["next"]
    import time  # reason: the backoff is real time (1 s here)

    time.sleep(max(0.0, wait - time.time()) + 0.05)
    assert reread_unsettled()["applied"] == 1
    undo.refresh_from_db()
    action.refresh_from_db()
    assert (undo.status, action.status) == ("done", "undone")
    assert undo.outcome["settled_later"] is True and undo.result_version == "3"
    assert Operation.objects.get(pk=undo.undo_of_id).status == "undone"
    [undone] = events(action, "write.undone")
    assert undone["settled_later"] is True
    assert reread_unsettled() == dict.fromkeys(RESULTS, 0)
    assert row(linked_rows.url, "acme") == ({"seats": 5}, 3)
