"""The last read (issue 39): a write to an external target whose attempts run out while an
earlier attempt may have reached the target (its answer lost, or its worker killed) is not
ended `failed` blind. One last delivery reads the target and sends nothing:

- our document under a new version → `applied` (once, with its undo window), the audit
  saying the last read settled it;
- still the version we wrote on → `failed`, the audit saying what the last read saw;
- the target cannot be read → `failed` with the outcome `unknown`: the lost attempt stays
  `unknown`, never "not applied" without evidence.

Real targets: a PostgreSQL table behind a TCP link the test breaks (tests/fixtures/
flaky_link.py: the UPDATE reaches the server and its answer is swallowed — a real lost
answer), Airlock's HTTP dialect answering too late, and a real worker SIGKILLed after the
target applied its write on its last attempt.
"""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Action, Operation
from approvals.services.execution import action_execute
from approvals.services.reconcile import reconcile
from approvals.services.undo import action_undo_request, undo_execute
from audit.models import AuditEvent
from audit.services import Actor
from ownership.models import Conflict
from tests.fixtures.engine import WORKER_LOCK_TTL_MS, wait_for, wait_until_due
from tests.fixtures.last_read import ROWS_ENV, Rows, events, propose_seats
from tests.fixtures.targets import row
from tests.targetserver import TargetServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _last_read_due(action: Action, attempts: int) -> None:
    """The attempts ran out and one of them may have reached the target: not `failed` —
    queued for one last read."""
    action.refresh_from_db()
    assert action.status == "queued", action.error
    assert action.attempts == attempts
    assert action.error["code"] in ("attempts_exhausted", "worker_lost")
    assert action.error["last_read"] == "due"
    assert len(events(action, "action.last_read_scheduled")) == 1
    assert not events(action, "action.failed")


@pytest.mark.parametrize("case", ["landed", "never_landed", "unreadable"])
def test_attempts_run_out_after_a_lost_answer_and_the_last_read_decides(
    engine_world: Any, engine_redis: Any, settings: Any, linked_rows: Rows, case: str
) -> None:
    settings.AIRLOCK_MAX_ATTEMPTS = 2
    settings.AIRLOCK_BACKOFF_BASE_SECONDS = 0.05
    link = linked_rows.link
    assert link is not None
    action = propose_seats(engine_world, linked_rows.kind)

    # Attempt 1: the UPDATE is sent and its answer lost. It reached the server (committed)
    # or it never did: Airlock cannot tell, the operation is `unknown`.
    landed = case != "never_landed"
    link.cut_next(b"UPDATE", deliver=landed)
    assert action_execute(action_id=action.pk) == "unknown"
    assert link.cuts_done == 1
    lost = Operation.objects.get(action=action)
    assert lost.status == "unknown"
    assert row(linked_rows.url, "acme") == (({"seats": 9}, 2) if landed else ({"seats": 5}, 1))

    # Attempt 2 (the last one allowed): the target is unreachable, so the read that would
    # settle attempt 1 fails. Before this change the action ended `failed` here.
    link.down()
    wait_until_due(action)
    action_execute(action_id=action.pk)
    _last_read_due(action, attempts=2)

    if case != "unreadable":
        link.up()
    wait_until_due(action)
    outcome = action_execute(action_id=action.pk)
    action.refresh_from_db()
    lost.refresh_from_db()

    if case == "landed":
        assert (outcome, action.status) == ("applied", "applied")
        assert action.error is None
        assert row(linked_rows.url, "acme") == ({"seats": 9}, 2)  # one UPDATE, not two
        assert lost.status == "done"  # the lost attempt made the effect
        assert lost.outcome["settled_by_reading"] is True and lost.outcome["last_read"] is True
        assert lost.result_version == "2" and lost.undo_deadline is not None
        [applied] = events(action, "write.applied")
        assert applied["last_read"] is True and applied["settled_by_reading"] is True
        assert applied["operation_id"] == lost.pk and applied["to_version"] == "2"
        assert not events(action, "action.failed")
        # The record is true, so undo works: the prior document, conditionally.
        undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
        assert undo_execute(undo_operation_id=undo.pk) == "undone"
        assert row(linked_rows.url, "acme") == ({"seats": 5}, 3)
    elif case == "never_landed":
        assert (outcome, action.status) == ("failed", "failed")
        assert row(linked_rows.url, "acme") == ({"seats": 5}, 1)  # nothing sent, ever
        assert action.error["code"] == "attempts_exhausted"
        assert action.error["last_read"] == "not_applied"
        assert action.error["current_version"] == "1"
        assert lost.status == "failed" and lost.outcome["settled"] == "not_applied"
        [failed] = events(action, "action.failed")
        assert failed["last_read"] == "not_applied" and failed["current_version"] == "1"
        assert not events(action, "write.applied")
    else:
        assert (outcome, action.status) == ("failed", "failed")
        # The write is there — and nothing on record says it is not.
        assert row(linked_rows.url, "acme") == ({"seats": 9}, 2)
        assert action.error["outcome"] == "unknown"
        assert action.error["last_read"] == "unsettled"
        assert str(action.error["reason"]).startswith("target_unreadable")
        assert lost.status == "unknown"  # still unsettled: not closed as "not applied"
        [failed] = events(action, "action.failed")
        assert failed["outcome"] == "unknown" and failed["last_read"] == "unsettled"
        assert not events(action, "write.applied")
    assert not Conflict.objects.filter(action=action).exists()


def test_an_http_write_whose_only_attempt_lost_its_answer_is_settled_by_the_last_read(
    engine_world: Any, engine_redis: Any, settings: Any, target: TargetServer
) -> None:
    """One attempt allowed; the target applied it and answered too late. The last read (a
    GET, never the PUT again) finds our document: applied, once."""
    settings.AIRLOCK_MAX_ATTEMPTS = 1
    settings.AIRLOCK_BACKOFF_BASE_SECONDS = 0.05
    settings.AIRLOCK_TARGET_TIMEOUT_SECONDS = 0.5
    kind = engine_world.hanging_http_kind(target, 1.5)
    action = engine_world.propose(kind, "prod", payload={"n": 2}, observed_version=1)
    assert action_execute(action_id=action.pk) == "unknown"
    _last_read_due(action, attempts=1)

    wait_until_due(action)
    assert action_execute(action_id=action.pk) == "applied"
    assert target.effects == 1 and len(target.requests) == 1  # read, not written again
    assert target.documents["prod"]["document"] == {"n": 2}
    done = Operation.objects.get(action=action, status="done")
    assert done.outcome["last_read"] is True and done.result_version == "2"
    [applied] = events(action, "write.applied")
    assert applied["last_read"] is True
    assert not events(action, "action.failed")


def test_a_worker_killed_after_the_target_applied_its_last_attempt_is_settled_by_the_last_read(
    engine_world: Any, rq_worker: Any, settings: Any, direct_rows: Rows
) -> None:
    """A real worker SIGKILLed after the target took the write, on the one attempt allowed:
    the reconciler takes the dead worker's operation back and, the attempts being spent,
    schedules the last read (it used to end the action `failed`, worker_lost); another worker
    reads our document and records it applied — one UPDATE in all."""
    settings.AIRLOCK_LOCK_TTL_MS = WORKER_LOCK_TTL_MS  # the in-process reconciler's view
    settings.AIRLOCK_MAX_ATTEMPTS = 1
    limits = {"AIRLOCK_MAX_ATTEMPTS": "1", "AIRLOCK_BACKOFF_BASE_SECONDS": "0.2"}
    env = {ROWS_ENV: direct_rows.url, **limits}
    doomed = rq_worker(AIRLOCK_TEST_CRASH_AT="external_after_target_applied", **env)
    action = propose_seats(engine_world, direct_rows.kind)
    wait_for(lambda: not doomed.alive(), timeout=30, interval=0.01)
    assert doomed.process.returncode == -9, doomed.output()
    assert row(direct_rows.url, "acme") == ({"seats": 9}, 2)  # taken; nothing on record

    def taken_back() -> bool:
        reconcile()  # the dead worker's operation: abandoned, and its attempts are spent
        return Action.objects.get(pk=action.pk).status != "executing"

    wait_for(taken_back, timeout=60, interval=0.2)
    _last_read_due(action, attempts=1)
    assert action.error["code"] == "worker_lost"

    survivor = rq_worker(**env)
    final = ("applied", "failed", "conflict")
    wait_for(lambda: Action.objects.get(pk=action.pk).status in final, timeout=60, interval=0.1)
    action.refresh_from_db()
    assert action.status == "applied", survivor.output()
    assert row(direct_rows.url, "acme") == ({"seats": 9}, 2)  # one UPDATE: read, not resent
    abandoned = Operation.objects.get(action=action, outcome__abandoned=True)
    assert abandoned.status == "failed"
    done = Operation.objects.get(action=action, status="done")
    assert done.outcome["last_read"] is True and done.result_version == "2"
    trail = list(
        AuditEvent.objects.filter(action_id=action.pk)
        .order_by("seq")
        .values_list("event_type", flat=True)
    )
    tail = ["operation.abandoned", "action.last_read_scheduled", "write.applied"]
    assert [e for e in trail if e in tail] == tail, trail
    assert "action.failed" not in trail
