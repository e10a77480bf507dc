"""Issue 38 §3: an undo refused because the resource moved commits its refusal and its
conflict in ONE transaction. A real worker is SIGKILLed between the two (the crash hook
`undo_refused_before_conflict`); before the fix the refusal had committed on its own,
leaving a failed undo that nobody was asked to decide.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from approvals.models import Operation
from approvals.services.execution import action_execute
from approvals.services.reconcile import reconcile
from approvals.services.undo import action_undo_request
from audit.models import AuditEvent
from audit.services import Actor
from ownership.models import Conflict, Resource
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _undo_state(undo_op: Operation) -> tuple[str, int, int, int]:
    action_id = undo_op.action_id
    return (
        Operation.objects.values_list("status", flat=True).get(pk=undo_op.pk),
        Conflict.objects.filter(action_id=action_id, origin="undo").count(),
        AuditEvent.objects.filter(event_type="write.undo_refused", action_id=action_id).count(),
        AuditEvent.objects.filter(event_type="conflict.opened", action_id=action_id).count(),
    )


def test_a_worker_killed_between_an_undo_refusal_and_its_conflict_leaves_neither_half(
    engine_world: Any, rq_worker: Any
) -> None:
    kind = engine_world.kind("cfg", update="recompute_field", owner_group="operators")
    engine_world.resource(kind, "a", {"n": 0})
    action = engine_world.propose(kind, "a", payload={"n": 1}, observed_version=1)
    assert action_execute(action_id=action.pk) == "applied"
    # Someone else writes after it: the undo must not restore {"n": 0} over their change.
    later = engine_world.propose(
        kind, "a", payload={"n": 2}, observed_version=2, run=engine_world.other_run
    )
    assert action_execute(action_id=later.pk) == "applied"
    undo_op = action_undo_request(action_id=action.pk, actor=Actor.person(engine_world.operator))

    doomed = rq_worker(AIRLOCK_TEST_CRASH_AT="undo_refused_before_conflict")
    wait_for(lambda: not doomed.alive(), timeout=30)
    assert doomed.process.returncode == -9, doomed.output()
    # Killed inside the one transaction: neither the refusal nor the conflict is there,
    # the undo is still pending (before the fix: failed, with no conflict).
    assert _undo_state(undo_op) == ("pending", 0, 0, 0)

    # The reconciler resends it (its worker is gone); a live worker refuses it again,
    # this time with its conflict.
    survivor = rq_worker()
    deadline = time.monotonic() + 45
    while _undo_state(undo_op)[0] == "pending" and time.monotonic() < deadline:
        reconcile()
        time.sleep(0.5)
    assert _undo_state(undo_op) == ("failed", 1, 1, 1), survivor.output()
    undo_op.refresh_from_db()
    assert (undo_op.outcome or {})["reason"] == "resource_moved"
    conflict = Conflict.objects.get(action_id=action.pk, origin="undo")
    assert conflict.status == "open" and conflict.proposed_document == {"n": 0}
    assert Resource.objects.get(kind=kind, name="a").document == {"n": 2}  # nothing erased
