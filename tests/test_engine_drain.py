"""The drain: one job applies its write and the next due ones on distinct resources
(group commit), each still fenced, audited and settled on its own — with the
collisions forced (two batches at once, a failing write, a worker killed mid-batch)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from approvals.models import Action, Operation
from approvals.outbox import engine_queue, marker_key
from approvals.services.execution import action_execute
from approvals.services.reconcile import reconcile
from audit.models import AuditEvent
from audit.services import audit_chain_verify
from engine.core import barrier, batch_write
from engine.core.fence import next_fence
from engine.core.lock import FencedLockGroup
from engine.core.operations import open_operations
from engine.core.write_rows import lock_batch_rows
from ownership.models import Resource, ResourceVersion
from tests.fixtures.engine import wait_for
from tests.races import WAIT, Holder, Worker

pytestmark = pytest.mark.django_db(transaction=True)


def _queued_updates(engine_world: Any, count: int, prefix: str = "d") -> list[Action]:
    """`count` queued updates, each of its own `cfg/<prefix>-<i>` resource at version 1."""
    return [engine_world.proposed_update(f"{prefix}-{i}", {"n": 0}, {"n": i}) for i in range(count)]


def _statuses(actions: list[Action]) -> list[str]:
    by_id = dict(Action.objects.filter(pk__in=[a.pk for a in actions]).values_list("pk", "status"))
    return [by_id[a.pk] for a in actions]


def _applied_exactly_once(actions: list[Action]) -> None:
    for action in actions:
        assert ResourceVersion.objects.filter(action_id=action.pk).count() == 1
        assert Operation.objects.filter(action=action, status="done").count() == 1
        applied = AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk)
        assert applied.count() == 1


def test_one_delivery_drains_the_due_writes_on_other_resources_under_one_fence(
    engine_world: Any, engine_redis: Any
) -> None:
    actions = _queued_updates(engine_world, 5)
    queue = engine_queue(engine_redis.client())
    assert queue.count == 5  # each approved write was enqueued after its commit
    # A second queued write to a batched resource waits for its own job: one write per
    # resource in a batch (made directly: only the drain is under test here).
    lead = Action.objects.get(pk=actions[2].pk)
    same_resource = Action.objects.create(
        run=lead.run,
        agent=lead.agent,
        kind=lead.kind,
        name="d-0",
        operation="update",
        payload_format=lead.payload_format,
        payload={"n": 99},
        observed_version=2,
        conflict_class=lead.conflict_class,
        status="queued",
    )

    assert action_execute(action_id=actions[2].pk, batch=10) == "applied"

    assert _statuses(actions) == ["applied"] * 5
    assert _statuses([same_resource]) == ["queued"]
    _applied_exactly_once(actions)
    fences = set(Operation.objects.filter(action__in=actions).values_list("fence", flat=True))
    assert len(fences) == 1  # one fence for every lock of the batch
    # The batch's events are one contiguous run of the chain, in proposal order.
    events = list(
        AuditEvent.objects.filter(event_type="write.applied").order_by("seq").values("seq")
    )
    assert [e["seq"] for e in events] == list(range(events[0]["seq"], events[0]["seq"] + 5))
    order = AuditEvent.objects.filter(event_type="write.applied").order_by("seq")
    assert list(order.values_list("action_id", flat=True)) == [a.pk for a in actions]
    assert audit_chain_verify().ok
    # The batched writes' own jobs left the queue; the lead's (called directly here)
    # stays, to find its action applied.
    assert queue.count == 1
    for action in (actions[0], actions[1], actions[3], actions[4]):
        assert engine_redis.client().get(marker_key("action", action.pk)) is None
    # A delivery of a batched write that ran anyway finds it done.
    assert action_execute(action_id=actions[4].pk, batch=10) == "skipped:applied"


def test_a_batch_of_plain_writes_costs_the_same_statements_whatever_its_size(
    engine_world: Any, engine_redis: Any
) -> None:
    """The plain updates of a batch land with one conditional UPDATE and are recorded with
    one statement per table (engine/core/batch_write.py), not four statements a write."""
    statements = []
    for size in (3, 12):
        actions = _queued_updates(engine_world, size, prefix=f"s{size}")
        with CaptureQueriesContext(connection) as queries:
            assert action_execute(action_id=actions[0].pk, batch=size) == "applied"
        assert _statuses(actions) == ["applied"] * size
        _applied_exactly_once(actions)
        statements.append(len(queries.captured_queries))
    assert statements[0] == statements[1]
    assert audit_chain_verify().ok


def test_a_batch_locks_its_rows_in_one_pipeline_that_fails_as_a_database_error(
    engine_world: Any,
) -> None:
    """A batch's rows are locked by the single write's four statements over the whole batch,
    pipelined (write_rows.py): one that times out behind another holder (here an action row)
    surfaces as Django's DatabaseError with the connection usable; once free, every write's
    rows come back, its resource with it, and a write whose operation is not its own is
    left out."""
    actions = _queued_updates(engine_world, 3, prefix="pl")
    operations = open_operations(
        action_ids=[a.pk for a in actions], fence=next_fence(), worker="w", lease_seconds=60
    )
    writes = [(a.pk, operations[a.pk].pk) for a in actions]
    holder = Holder(lambda: Action.objects.select_for_update().get(pk=actions[1].pk)).hold()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        with pytest.raises(DatabaseError), transaction.atomic():
            lock_batch_rows(writes)
    finally:
        holder.release()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    with transaction.atomic():
        rows = lock_batch_rows([*writes[:2], (actions[2].pk, operations[actions[0].pk].pk)])
    assert set(rows) == {actions[0].pk, actions[1].pk}
    for action in actions[:2]:
        locked = rows[action.pk]
        assert locked.operation.pk == operations[action.pk].pk
        assert locked.action.kind_id == "cfg" and locked.action.run.agent_id is not None
        assert locked.run_state is not None and locked.run_state[0] == "active"
        assert locked.switches_clear
        assert locked.resource["document"] == {"n": 0}


def test_a_mixed_batch_keeps_proposal_order_across_creates_and_misses(
    engine_world: Any, engine_redis: Any
) -> None:
    """A create (applied on its own) and a stale update (refused on its own) in the middle
    of plain updates: every write gets its own outcome and the batch's audit events stay
    one contiguous run in proposal order."""
    first = _queued_updates(engine_world, 2, prefix="m")
    created = engine_world.proposed_create("m-new.example.com", {"ttl": 60})
    stale, last = _queued_updates(engine_world, 2, prefix="n")
    Resource.objects.filter(kind=stale.kind, name=stale.name).update(version=2)
    actions = [*first, created, stale, last]

    assert action_execute(action_id=first[0].pk, batch=5) == "applied"

    assert _statuses(actions) == ["applied", "applied", "applied", "conflict", "applied"]
    _applied_exactly_once([*first, created, last])
    events = AuditEvent.objects.filter(event_type__in=["write.applied", "write.refused"])
    ordered = list(events.order_by("seq").values_list("seq", "action_id", "event_type"))
    assert [action_id for _, action_id, _ in ordered] == [a.pk for a in actions]
    assert [seq for seq, _, _ in ordered] == list(range(ordered[0][0], ordered[0][0] + 5))
    assert ordered[3][2] == "write.refused"
    assert audit_chain_verify().ok


def test_two_batches_claiming_overlapping_writes_apply_each_exactly_once(
    engine_world: Any, engine_redis: Any, monkeypatch: Any
) -> None:
    actions = _queued_updates(engine_world, 12)
    # Both deliveries hold their own lock before either chooses its companions: their
    # candidates (the oldest due writes) overlap, and the companions' locks split them.
    both_locked = threading.Barrier(2, timeout=WAIT)
    real_init = FencedLockGroup.__init__

    def group_when_both_locked(group: FencedLockGroup, redis: Any, locks: Any) -> None:
        both_locked.wait()
        real_init(group, redis, locks)

    monkeypatch.setattr(FencedLockGroup, "__init__", group_when_both_locked)
    first = Worker(lambda: action_execute(action_id=actions[0].pk, batch=12))
    second = Worker(lambda: action_execute(action_id=actions[11].pk, batch=12))
    first.start()
    second.start()
    assert (first.finish(), second.finish()) == ("applied", "applied")

    assert _statuses(actions) == ["applied"] * 12
    _applied_exactly_once(actions)
    assert len(set(Operation.objects.values_list("fence", flat=True))) == 2
    assert audit_chain_verify().ok


def test_a_claim_races_another_claim_of_the_same_writes_and_each_is_claimed_once(
    engine_world: Any, engine_redis: Any
) -> None:
    """The claim itself (a conditional UPDATE from `queued`) is the last guard: two
    batches that reach it with the same writes (say a lock that expired in between)
    split them, never share one."""
    ids = [a.pk for a in _queued_updates(engine_world, 8)]
    start = threading.Barrier(2, timeout=WAIT)

    def claim(fence: int) -> set[Any]:
        start.wait()
        return set(open_operations(action_ids=ids, fence=fence, worker="t", lease_seconds=30))

    claims = [Worker(lambda f=fence: claim(f)) for fence in (1_000_001, 1_000_002)]
    for worker in claims:
        worker.start()
    won = [worker.finish() for worker in claims]
    assert not (won[0] & won[1])
    assert won[0] | won[1] == set(ids)
    assert Operation.objects.count() == 8
    assert set(Action.objects.filter(pk__in=ids).values_list("status", flat=True)) == {"executing"}


def test_a_failing_write_in_a_batch_does_not_lose_the_others(
    engine_world: Any, engine_redis: Any, monkeypatch: Any
) -> None:
    actions = _queued_updates(engine_world, 4)
    doomed = Resource.objects.get(kind=actions[1].kind, name=actions[1].name)
    real_land = barrier.land_write

    def land_fails_for_one(planned: Any, **kwargs: Any) -> bool:
        # PostgreSQL lands a single update with its records in one statement (land.py).
        if planned.resource_id == doomed.pk:
            raise DatabaseError("the disk said no")
        return real_land(planned, **kwargs)

    monkeypatch.setattr(barrier, "land_write", land_fails_for_one)
    real_together = batch_write._update_together

    def fail_together(writes: Any, **kwargs: Any) -> set[int]:
        if any(written.resource_id == doomed.pk for written in writes):
            raise DatabaseError("the disk said no")
        return real_together(writes, **kwargs)

    # The batch tries its writes together first (one UPDATE), then one at a time.
    monkeypatch.setattr(batch_write, "_update_together", fail_together)
    # A second kind of failure in the same batch: a stale version (someone wrote first).
    Resource.objects.filter(kind=actions[2].kind, name=actions[2].name).update(version=2)

    assert action_execute(action_id=actions[0].pk, batch=4) == "applied"

    assert _statuses(actions) == ["applied", "queued", "conflict", "applied"]
    _applied_exactly_once([actions[0], actions[3]])
    failed = Action.objects.get(pk=actions[1].pk)
    assert failed.attempts == 1 and failed.not_before is not None  # retried with backoff
    assert Operation.objects.get(action=failed).status == "failed"
    assert not ResourceVersion.objects.filter(action_id=failed.pk).exists()
    assert Resource.objects.get(pk=doomed.pk).version == 1
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=failed.pk).exists()
    assert (
        AuditEvent.objects.filter(event_type="write.refused", action_id=actions[2].pk).count() == 1
    )
    assert audit_chain_verify().ok

    monkeypatch.setattr(barrier, "land_write", real_land)
    Action.objects.filter(pk=failed.pk).update(not_before=None)
    assert action_execute(action_id=failed.pk, batch=4) == "applied"
    _applied_exactly_once([failed])


@pytest.mark.slow
def test_a_worker_killed_mid_batch_leaves_nothing_half_applied_and_the_reconciler_finishes(
    engine_world: Any, engine_redis: Any, rq_worker: Any
) -> None:
    actions = _queued_updates(engine_world, 6)
    doomed = rq_worker(AIRLOCK_TEST_CRASH_AT="inside_barrier_before_commit")
    wait_for(lambda: not doomed.alive(), timeout=20)
    assert doomed.process.returncode == -9, doomed.output()

    # The batch's transaction never committed: no write, no event, every claim pending.
    assert not ResourceVersion.objects.filter(action__in=actions).exists()
    assert not AuditEvent.objects.filter(event_type="write.applied").exists()
    assert set(_statuses(actions)) == {"executing"}
    assert Operation.objects.filter(action__in=actions, status="pending").count() == 6

    # The reconciler takes claims back only after their lease, which outlives the locks:
    # wait for the dead batch's locks to expire rather than only pretend the time passed.
    wait_for(lambda: not engine_redis.client().keys("airlock:lock:*"), timeout=20)
    counts = reconcile(now=timezone.now() + timedelta(seconds=30))
    assert counts["abandoned"] == 6
    survivor = rq_worker()
    wait_for(lambda: set(_statuses(actions)) == {"applied"}, timeout=30)
    _applied_exactly_once(actions)
    assert Resource.objects.filter(name__startswith="d-", version=2).count() == 6, survivor.output()
    assert audit_chain_verify().ok
    assert reconcile(now=timezone.now() + timedelta(seconds=30))["requeued"] == 0
