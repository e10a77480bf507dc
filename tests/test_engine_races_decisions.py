"""Forced collisions between decisions (review findings 3, 4, 14 and T4), on real
PostgreSQL: lock order between a run's approval, a run created on the same kind, a cancel and
a revoke; two operators on one quorum-2 approval; two resolvers on one conflict.
tests/test_engine_races.py holds the collisions around a write in flight.

Each test forces the interleaving: one thread holds a transaction open at a
chosen point (threading.Event), the other is started and the test waits until
PostgreSQL reports it blocked on a lock (pg_stat_activity), then releases the
first. No sleeps as synchronisation. Each asserts the invariant: no deadlock,
one effect recorded once, one resolution.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import DatabaseError, transaction
from django.utils import timezone

from approvals.models import Action, Approval, ApprovalDecision, Run
from approvals.services.actions import action_cancel
from approvals.services.decisions import approval_decide
from approvals.services.execution import action_execute
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import InvalidTransition
from ownership.models import Conflict, ConflictClass, Resource
from ownership.services.resolution import conflict_resolve
from tests.races import WAIT, Holder, Worker, finish_each, wait_for_lock_waiters

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


# -- helpers -------------------------------------------------------------------------


def _lock_action_row(action: Action) -> Any:
    return list(Action.objects.select_for_update().filter(pk=action.pk))


@pytest.fixture
def world(engine_world: Any, engine_redis: Any) -> Any:
    return engine_world


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
    decider = _deciding(world, approval, "approve")
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
    decider = _deciding(world, approval, "approve")
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
    errors = finish_each(canceller, revoker)
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
    assert follow_up.operation == "delete" and follow_up.observed_version == "2"
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


# -- issue 11: a call's decision locks run, action and approval in one statement ----------


def _lockable_now(model: Any, pk: Any) -> bool:
    """Can another session lock this row FOR UPDATE right now (NOWAIT)?"""
    try:
        with transaction.atomic():
            list(model.objects.select_for_update(nowait=True).filter(pk=pk).values_list("pk"))
    except DatabaseError:
        return False
    return True


def _deciding(world: Any, approval: Approval, decision: str) -> Worker:
    """The operator's decision, started in a thread of its own (it will wait on a lock)."""
    decider = Worker(
        lambda: approval_decide(
            approval_id=approval.pk, actor=Actor.person(world.operator), decision=decision
        )
    )
    decider.start()
    return decider


def test_a_decision_waiting_for_its_run_holds_neither_the_action_nor_the_approval(
    world: Any, policy: Any
) -> None:
    action = world.propose(policy, "prod-alerts", payload={"severity": "low"}, observed_version=1)
    approval = Approval.objects.get(action=action)
    # A revoke or a finish holds the run row first.
    blocker = Holder(lambda: list(Run.objects.select_for_update().filter(pk=world.run.pk)))
    blocker.hold()
    decider = _deciding(world, approval, "approve")
    wait_for_lock_waiters(1, threads=(decider,))
    assert _lockable_now(Action, action.pk) and _lockable_now(Approval, approval.pk)
    blocker.release()
    assert decider.finish().status == "approved"
    assert Action.objects.get(pk=action.pk).status == "queued"


def test_a_decision_waiting_for_its_action_holds_the_run_but_not_the_approval(
    world: Any, policy: Any
) -> None:
    action = world.propose(policy, "prod-alerts", payload={"severity": "low"}, observed_version=1)
    approval = Approval.objects.get(action=action)
    blocker = Holder(lambda: _lock_action_row(action))
    blocker.hold()
    decider = _deciding(world, approval, "reject")
    wait_for_lock_waiters(1, threads=(decider,))
    # The run is held FOR SHARE by the decision already; the approval not yet.
    assert not _lockable_now(Run, world.run.pk)
    assert _lockable_now(Approval, approval.pk)
    blocker.release()
    assert decider.finish().status == "rejected"
    action.refresh_from_db()
    assert action.status == "rejected" and action.error["code"] == "rejected"
