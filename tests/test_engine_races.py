"""Forced collisions (review findings 2, 3, 4, 7, 8, 14 and T4), on real PostgreSQL.

Each test forces the interleaving: one thread holds a transaction open at a
chosen point (threading.Event), the other is started and the test waits until
PostgreSQL reports it blocked on a lock (pg_stat_activity), then releases the
first. No sleeps as synchronisation. Each asserts the invariant: nothing
written after a revoke or an engage committed, no deadlock, one effect
recorded once, one resolution.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, transaction
from django.utils import timezone

from approvals.models import Action, Approval, ApprovalDecision, Operation, Run
from approvals.services.actions import action_cancel
from approvals.services.attempts import WORKER_ACTOR, operation_lease_seconds
from approvals.services.decisions import approval_decide
from approvals.services.execution import action_execute
from approvals.services.reconcile import reconcile
from audit.models import AuditEvent
from audit.services import Actor
from console.core.barrier import RUN_NOT_ACTIVE, apply_action
from console.core.errors import InvalidTransition, KillSwitchEngaged
from console.core.fence import next_fence
from console.core.lock import lock_key
from console.core.operations import open_operation
from console.models import KillSwitch
from console.services import kill_switch_set
from ownership.models import Conflict, ConflictClass, Resource
from ownership.services.resolution import conflict_resolve
from tests.races import WAIT, Holder, Worker, wait_for_lock_waiters
from tests.targetserver import TargetServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


# -- helpers -------------------------------------------------------------------------


def _lock_action_row(action: Action) -> Any:
    return list(Action.objects.select_for_update().filter(pk=action.pk))


@pytest.fixture
def world(engine_world: Any, engine_redis: Any) -> Any:
    return engine_world


@pytest.fixture
def cfg(world: Any) -> Any:
    kind = world.kind("cfg", update="recompute_field", owner_group="owners")
    world.resource(kind, "a", {"v": 1})
    return kind


@pytest.fixture
def policy(world: Any) -> Any:
    kind = world.kind("notification-policy")  # replace_shared_document: per-call
    world.resource(kind, "prod-alerts", {"destinations": ["oncall"], "severity": "high"})
    return kind


def _claimed(world: Any, kind: Any) -> tuple[Action, Operation, int]:
    """A queued per-run write claimed by a worker (action `executing`, operation pending)."""
    action = world.propose(kind, "a", payload={"v": 2}, observed_version=1)
    fence = next_fence()
    operation = open_operation(action_id=action.pk, fence=fence, worker="w", lease_seconds=30)
    return action, operation, fence


# -- finding 2: revoke vs execution ---------------------------------------------------


def test_a_revoke_committing_while_the_barrier_runs_means_nothing_is_applied(
    world: Any, cfg: Any
) -> None:
    action, operation, fence = _claimed(world, cfg)
    from approvals.services.runs import run_revoke

    revoke = Holder(
        lambda: run_revoke(
            run=Run.objects.get(pk=world.run.pk), actor=Actor.person(world.operator), reason="leak"
        )
    ).hold()  # the revoke has run; its transaction (run row, audit head) is open
    execute = Worker(
        lambda: apply_action(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
        )
    )
    execute.start()
    wait_for_lock_waiters(1, threads=(execute,))  # the barrier waits for the revoke
    revoke.release()  # the revoke commits first
    outcome = execute.finish()

    assert outcome.applied is False and outcome.reason == RUN_NOT_ACTIVE
    action.refresh_from_db()
    assert action.status == "cancelled" and action.error["code"] == "run_not_active"
    resource = Resource.objects.get(kind=cfg, name="a")
    assert resource.document == {"v": 1} and resource.version == 1
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).exists()
    assert Operation.objects.get(pk=operation.pk).status == "failed"


def test_a_run_past_expires_at_writes_nothing_before_housekeeping_marks_it(
    world: Any, cfg: Any
) -> None:
    action, operation, fence = _claimed(world, cfg)
    Run.objects.filter(pk=world.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    outcome = apply_action(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
    )
    assert outcome.reason == RUN_NOT_ACTIVE
    action.refresh_from_db()
    assert action.status == "expired"
    assert Resource.objects.get(kind=cfg, name="a").version == 1


def test_a_queued_action_of_an_expired_run_ends_expired_through_the_job(
    world: Any, cfg: Any
) -> None:
    action = world.propose(cfg, "a", payload={"v": 2}, observed_version=1)
    Run.objects.filter(pk=world.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert action_execute(action_id=action.pk) == "run_not_active"
    action.refresh_from_db()
    assert action.status == "expired"


def _active_run(world: Any, resource: str) -> Run:
    from approvals.services import runs

    run, _ = runs.run_create(
        agent=world.agent,
        task="writes " + resource,
        write_set=[{"resource": resource, "operations": ["update"]}],
        ttl_seconds=None,
        actor=Actor.agent(world.agent),
    )
    approval_decide(
        approval_id=Approval.objects.get(run=run, subject="run").pk,
        actor=Actor.person(world.operator),
        decision="approve",
    )
    run.refresh_from_db()
    assert run.status == "active"
    return run


def test_a_write_proposed_in_the_gap_after_a_revoke_is_never_applied(world: Any, cfg: Any) -> None:
    """The order the race produces (review repro): the API's run check passes, the
    operator's revoke commits, then the action is recorded and executed."""
    from approvals.services import actions, preconditions, runs

    run = _active_run(world, "cfg/a")
    kind = actions.action_check_writable(run=run, kind="cfg", name="a", operation="update")
    runs.run_revoke(run=run, actor=Actor.person(world.operator), reason="token leaked")
    proposal = actions.Proposal(
        kind=kind,
        name="a",
        operation="update",
        payload_format="replace",
        payload={"v": 9},
        if_match=preconditions.parse_tag_condition('"1"', header="If-Match"),
        create_if_absent=False,
        idempotency_key="gap-1",
        reason="",
    )
    try:
        action = actions.action_propose(run=run, proposal=proposal)
    except runs.RunNotActive:
        pass  # once action_propose re-checks the run under its lock (API area)
    else:
        assert action_execute(action_id=action.pk) in ("run_not_active", "skipped:cancelled")
        action.refresh_from_db()
        assert action.status == "cancelled"
    resource = Resource.objects.get(kind=cfg, name="a")
    assert resource.version == 1 and resource.document == {"v": 1}
    assert not AuditEvent.objects.filter(event_type="write.applied", run_id=run.pk).exists()


# -- finding 3: lock order ----------------------------------------------------------


def test_approving_a_run_while_another_run_of_the_kind_is_created_does_not_deadlock(
    world: Any,
) -> None:
    from approvals.services import runs, write_sets

    world.kind("dns-zone")
    pending, _ = runs.run_create(
        agent=world.agent,
        task="needs approval",
        write_set=[{"resource": "dns-zone/a", "operations": ["update"]}],
        ttl_seconds=None,
        actor=Actor.agent(world.agent),
    )
    assert pending.status == "pending_approval"
    approval = Approval.objects.get(run=pending, subject="run")

    # run_create takes the kind's advisory lock, then appends audit. Hold it there.
    gate = threading.Event()

    def create() -> Any:
        with transaction.atomic():
            write_sets.lock_kinds({"dns-zone"})
            gate.set()
            assert release.wait(WAIT)
            return runs.run_create(
                agent=world.agent,
                task="second",
                write_set=[{"resource": "dns-zone/b", "operations": ["update"]}],
                ttl_seconds=None,
                actor=Actor.agent(world.agent),
            )

    release = threading.Event()
    creator = Worker(create)
    creator.start()
    assert gate.wait(WAIT)
    decider = Worker(
        lambda: approval_decide(
            approval_id=approval.pk, actor=Actor.person(world.operator), decision="approve"
        )
    )
    decider.start()
    wait_for_lock_waiters(1, threads=(decider,))  # the decision waits for the kind lock
    release.set()
    second, _ = creator.finish()  # no OperationalError('deadlock detected') on either side
    decided = decider.finish()

    assert decided.status == "approved"
    pending.refresh_from_db()
    assert pending.status == "active"
    assert Run.objects.get(pk=second.pk).status == "pending_approval"


def _cancel_holding_the_action_row(action: Action, actor: Actor) -> tuple[Worker, threading.Event]:
    """A started worker that locks the action row (action_cancel's first lock) and,
    once `release` is set, cancels the action in that transaction: the other side
    of a race starts in between and must queue behind it, not deadlock."""
    release = threading.Event()
    gate = threading.Event()

    def cancel() -> Any:
        with transaction.atomic():
            _lock_action_row(action)
            gate.set()
            assert release.wait(WAIT)
            return action_cancel(action=Action.objects.get(pk=action.pk), actor=actor)

    canceller = Worker(cancel)
    canceller.start()
    assert gate.wait(WAIT)
    return canceller, release


def test_approving_and_cancelling_one_action_at_once_does_not_deadlock(
    world: Any, policy: Any
) -> None:

    action = world.propose(policy, "prod-alerts", payload={"severity": "low"}, observed_version=1)
    approval = Approval.objects.get(action=action)
    # action_cancel locks the action row first (its conditional UPDATE), then the approval.
    canceller, release = _cancel_holding_the_action_row(action, Actor.run(world.run))
    decider = Worker(
        lambda: approval_decide(
            approval_id=approval.pk, actor=Actor.person(world.operator), decision="approve"
        )
    )
    decider.start()
    wait_for_lock_waiters(1, threads=(decider,))
    release.set()
    cancelled = canceller.finish()
    with pytest.raises(InvalidTransition) as excinfo:  # 409, never a deadlock (500)
        decider.finish()
    assert excinfo.value.code == "already_decided"
    assert cancelled.status == "cancelled"
    approval.refresh_from_db()
    assert approval.status == "cancelled"
    assert not AuditEvent.objects.filter(event_type="approval.approved").exists()


def test_cancelling_an_action_while_its_run_is_revoked_does_not_deadlock(
    world: Any, policy: Any
) -> None:
    """Needs runs._end (API area) to update the run's actions before its approvals
    (run -> action -> approval -> audit); before that change this deadlocked."""
    from approvals.services.runs import run_revoke

    action = world.propose(policy, "prod-alerts", payload={"severity": "low"}, observed_version=1)
    canceller, release = _cancel_holding_the_action_row(action, Actor.run(world.run))
    revoker = Worker(
        lambda: run_revoke(
            run=Run.objects.get(pk=world.run.pk), actor=Actor.person(world.operator), reason="stop"
        )
    )
    revoker.start()
    wait_for_lock_waiters(1, threads=(revoker,))
    release.set()
    errors = []
    for thread in (canceller, revoker):
        try:
            thread.finish()
        except OperationalError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    action.refresh_from_db()
    assert action.status == "cancelled"
    assert Run.objects.get(pk=world.run.pk).status == "revoked"


# -- T4: two operators, one quorum-2 approval ------------------------------------------


def test_two_operators_deciding_a_quorum_two_approval_at_once_both_count(
    world: Any, policy: Any
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    action = world.propose(policy, "prod-alerts", payload={"severity": "low"}, observed_version=1)
    approval = Approval.objects.get(action=action)
    blocker = Holder(lambda: list(Approval.objects.select_for_update().filter(pk=approval.pk)))
    blocker.hold()
    deciders = [
        Worker(
            lambda p=person: approval_decide(
                approval_id=approval.pk, actor=Actor.person(p), decision="approve"
            )
        )
        for person in (world.operator, world.operator2)
    ]
    for decider in deciders:
        decider.start()
    wait_for_lock_waiters(2, threads=tuple(deciders))  # both are in, neither has counted
    blocker.release()
    for decider in deciders:
        decider.finish()

    approval.refresh_from_db()
    action.refresh_from_db()
    assert ApprovalDecision.objects.filter(approval=approval).count() == 2
    assert approval.status == "approved" and action.status == "queued"
    assert (
        AuditEvent.objects.filter(event_type="approval.approved", action_id=action.pk).count() == 1
    )


# -- conflicts: T4 two resolvers, finding 4 quorum, finding 14 undo of a create ----------


def _collide(world: Any, kind: Any, name: str) -> Action:
    """The agent read v1, someone else wrote v2 first: a conflict for a person."""
    action: Action = world.collide(
        kind,
        name,
        {"destinations": ["oncall", "backup"]},
        {"destinations": ["oncall"], "severity": "critical"},
    )
    return action


def test_two_resolvers_resolving_one_conflict_at_once_make_one_resolution(world: Any) -> None:
    kind = world.kind("shared-doc", update="replace_shared_document")  # resolver: operators
    action = _collide(world, kind, "x")
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    blocker = Holder(lambda: list(Conflict.objects.select_for_update().filter(pk=conflict.pk)))
    blocker.hold()
    resolvers = [
        Worker(
            lambda p=person, c=choice: conflict_resolve(
                conflict_id=conflict.pk, actor=Actor.person(p), choice=c
            )
        )
        for person, choice in ((world.operator, "take_proposed"), (world.operator2, "merge"))
    ]
    for resolver in resolvers:
        resolver.start()
    wait_for_lock_waiters(2, threads=tuple(resolvers))
    blocker.release()
    outcomes: list[Any] = []
    for resolver in resolvers:
        try:
            outcomes.append(resolver.finish())
        except InvalidTransition as exc:
            assert exc.code == "already_decided"
            outcomes.append(None)
    assert sum(o is not None for o in outcomes) == 1
    assert Action.objects.filter(parent=action).count() == 1
    assert (
        AuditEvent.objects.filter(event_type="conflict.resolved", action_id=action.pk).count() == 1
    )
    conflict.refresh_from_db()
    assert conflict.status == "resolved"
    assert conflict.resolution_action_id == Action.objects.get(parent=action).pk


def test_a_resolution_of_a_quorum_two_class_waits_for_a_second_person(world: Any) -> None:
    account_owner = world.person("ali", "account-owners")
    kind = world.kind("group", update="access_change")
    action = _collide(world, kind, "admins")
    ConflictClass.objects.filter(slug="access_change").update(quorum=2)
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])

    resolved = conflict_resolve(
        conflict_id=conflict.pk, actor=Actor.person(account_owner), choice="take_proposed"
    )
    follow_up = Action.objects.get(pk=resolved.resolution_action_id)
    approval = Approval.objects.get(action=follow_up)
    assert follow_up.status == "pending_approval"
    assert approval.status == "pending" and approval.quorum == 2
    assert list(
        ApprovalDecision.objects.filter(approval=approval).values_list("person", flat=True)
    ) == [account_owner.pk]
    assert action_execute(action_id=follow_up.pk) == "skipped:pending_approval"
    assert Resource.objects.get(kind=kind, name="admins").version == 2

    approval_decide(approval_id=approval.pk, actor=Actor.person(world.operator), decision="approve")
    follow_up.refresh_from_db()
    assert follow_up.status == "queued"
    assert action_execute(action_id=follow_up.pk) == "applied"
    resource = Resource.objects.get(kind=kind, name="admins")
    assert resource.version == 3 and resource.document == {"destinations": ["oncall", "backup"]}


def test_resolving_the_undo_conflict_of_a_create_deletes_the_resource(world: Any) -> None:
    kind = world.kind("cfg2", create="add_unique", update="recompute_field", owner_group="owners")
    requester = world.person("oscar", "owners")
    resolver = world.person("otto", "owners")
    created = world.propose(kind, "new", operation="create", payload={"v": 1})
    assert action_execute(action_id=created.pk) == "applied"
    conflict = world.undo_into_conflict(
        created, later_payload={"v": 2}, observed_version=1, requester=requester, key="undo-c-1"
    )
    resolved = conflict_resolve(
        conflict_id=conflict.pk, actor=Actor.person(resolver), choice="take_proposed"
    )
    follow_up = Action.objects.get(pk=resolved.resolution_action_id)
    assert follow_up.operation == "delete" and follow_up.observed_version == 2
    assert action_execute(action_id=follow_up.pk) == "applied"
    resource = Resource.objects.get(kind=kind, name="new")
    assert resource.deleted is True and resource.version == 3


@pytest.mark.parametrize("ended", ["finished", "revoked", "expired"])
def test_a_resolution_decided_after_its_run_ended_still_runs(world: Any, ended: str) -> None:
    """The documented exemption: a resolution action is a person's decision."""
    kind = world.kind("shared-doc", update="replace_shared_document")
    action = _collide(world, kind, "y")
    Run.objects.filter(pk=world.run.pk).update(status=ended, ended_at=timezone.now())
    resolved = conflict_resolve(
        conflict_id=action.error["conflict_id"],
        actor=Actor.person(world.operator2),
        choice="take_proposed",
    )
    assert action_execute(action_id=resolved.resolution_action_id) == "applied"


# -- finding 7: kill switch vs a barrier in flight --------------------------------------


def test_a_barrier_that_starts_during_an_engage_writes_nothing(world: Any, cfg: Any) -> None:
    action, operation, fence = _claimed(world, cfg)
    engage = Holder(
        lambda: kill_switch_set(
            scope="*", engaged=True, reason="incident", actor=Actor.person(world.operator)
        )
    ).hold()  # the engage is in its transaction (switch row and audit head held)
    execute = Worker(
        lambda: apply_action(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
        )
    )
    execute.start()
    wait_for_lock_waiters(1, threads=(execute,))  # the barrier is inside, waiting
    engage.release()  # the engage returns to the operator
    with pytest.raises(KillSwitchEngaged):
        execute.finish()
    resource = Resource.objects.get(kind=cfg, name="a")
    assert resource.version == 1 and resource.document == {"v": 1}
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).exists()
    assert Operation.objects.get(pk=operation.pk).status == "pending"


def test_an_engage_waits_for_a_barrier_already_past_its_check(world: Any, cfg: Any) -> None:
    action, operation, fence = _claimed(world, cfg)
    barrier = Holder(
        lambda: apply_action(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=WORKER_ACTOR
        )
    ).hold()  # written, not yet committed
    engaged = threading.Event()

    def engage() -> Any:
        switch = kill_switch_set(
            scope="*", engaged=True, reason="incident", actor=Actor.person(world.operator)
        )
        engaged.set()
        return switch

    engager = Worker(engage)
    engager.start()
    wait_for_lock_waiters(1, threads=(engager,))
    assert not engaged.is_set()  # the operator is not told "engaged" while a write is open
    assert barrier.release().applied is True
    assert engager.finish().engaged is True
    write = AuditEvent.objects.get(event_type="write.applied", action_id=action.pk)
    switch = AuditEvent.objects.get(event_type="kill_switch.engaged")
    assert write.seq < switch.seq
    assert KillSwitch.objects.get(scope="*").engaged


# -- finding 8: a stale HTTP worker records nothing twice -------------------------------


def _queued_http_write(world: Any, target: TargetServer, settings: Any) -> Action:
    """A queued update of ext-policy/prod, an HTTP target at version 4 (5 s timeout)."""
    settings.AIRLOCK_TARGET_TIMEOUT_SECONDS = 5
    kind = world.kind("ext-policy", update="recompute_field", target_url=target.url)
    target.seed("prod", {"severity": "high"}, version=4)
    action: Action = world.propose(kind, "prod", payload={"severity": "low"}, observed_version=4)
    return action


def test_a_stale_http_worker_resuming_after_a_replay_records_nothing_twice(
    world: Any, engine_redis: Any, target: TargetServer, settings: Any, monkeypatch: Any
) -> None:
    from console.core import targets

    action = _queued_http_write(world, target, settings)

    real_write = targets.HttpTarget.write
    sent = threading.Event()
    resume = threading.Event()
    calls: list[int] = []

    def write(self: Any, **kwargs: Any) -> Any:
        response = real_write(self, **kwargs)
        calls.append(kwargs["fence"])
        if len(calls) == 1:  # worker A: the target applied it; A is paused (GC, SIGSTOP)
            sent.set()
            assert resume.wait(WAIT)
        return response

    monkeypatch.setattr(targets.HttpTarget, "write", write)
    worker_a = Worker(lambda: action_execute(action_id=action.pk))
    worker_a.start()
    assert sent.wait(WAIT)
    op_a = Operation.objects.get(action=action)
    # A stays paused past its lock TTL and its lease: the lock expires, the
    # reconciler abandons A's operation and requeues the action.
    engine_redis.client().delete(lock_key(action.resource_identifier))
    later = timezone.now() + timedelta(seconds=operation_lease_seconds() + 1)
    assert reconcile(now=later, connection=engine_redis.client())["abandoned"] == 1
    # Worker B replays with the same Idempotency-Key and records the effect.
    assert action_execute(action_id=action.pk) == "applied"
    resume.set()
    assert worker_a.finish() == "superseded"

    assert target.effects == 1 and len(calls) == 2
    action.refresh_from_db()
    assert action.status == "applied"
    assert Operation.objects.filter(action=action, status="done").count() == 1
    op_a.refresh_from_db()
    assert op_a.status == "failed" and op_a.outcome.get("abandoned") is True
    assert AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).count() == 1


def test_a_stale_http_worker_resuming_with_a_retry_does_not_steal_the_new_claim(
    world: Any, engine_redis: Any, target: TargetServer, settings: Any, monkeypatch: Any
) -> None:
    from console.core import targets

    action = _queued_http_write(world, target, settings)
    target.fail_next(503)  # worker A is told "try later" ...

    real_write = targets.HttpTarget.write
    answered = threading.Event()
    resume = threading.Event()

    def write(self: Any, **kwargs: Any) -> Any:
        response = real_write(self, **kwargs)
        answered.set()
        assert resume.wait(WAIT)  # ... and is paused before it acts on the answer
        return response

    monkeypatch.setattr(targets.HttpTarget, "write", write)
    worker_a = Worker(lambda: action_execute(action_id=action.pk))
    worker_a.start()
    assert answered.wait(WAIT)
    later = timezone.now() + timedelta(seconds=operation_lease_seconds() + 1)
    assert reconcile(now=later, connection=engine_redis.client())["abandoned"] == 1
    # Worker B claims the requeued action (its operation is pending, not yet sent).
    op_b = open_operation(action_id=action.pk, fence=next_fence(), worker="b", lease_seconds=30)
    resume.set()
    worker_a.finish()

    action.refresh_from_db()
    assert action.status == "executing" and action.not_before is None
    assert Operation.objects.get(pk=op_b.pk).status == "pending"
    assert not AuditEvent.objects.filter(
        event_type="action.retry_scheduled", action_id=action.pk
    ).exists()


def test_an_http_write_claimed_before_an_engage_is_not_sent_after_it(
    world: Any, engine_redis: Any, target: TargetServer, monkeypatch: Any
) -> None:
    """An external target has no barrier transaction: the switch is re-checked right
    before sending. The engage is forced between the worker's claim and its send."""
    from approvals.services import attempts

    kind = world.kind("ext-policy", update="recompute_field", target_url=target.url)
    target.seed("prod", {"severity": "high"}, version=4)
    action = world.propose(kind, "prod", payload={"severity": "low"}, observed_version=4)
    real_notify = attempts.notify_action_changed_now

    def claimed_then_engaged(action_id: Any) -> None:
        real_notify(action_id)
        kill_switch_set(
            scope="ext-policy/*",
            engaged=True,
            reason="incident",
            actor=Actor.person(world.operator),
        )

    monkeypatch.setattr(attempts, "notify_action_changed_now", claimed_then_engaged)
    assert action_execute(action_id=action.pk) == "paused"
    action.refresh_from_db()
    assert action.status == "paused" and action.paused_reason == "incident"
    assert target.requests == [] and target.effects == 0
    assert Operation.objects.get(action=action).status == "failed"
