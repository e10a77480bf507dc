"""Smaller service contracts: kill switch, stale fence routing, selectors."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Action, Operation, Run
from approvals.selectors import actions_visible_to, approval_list_for_person
from approvals.services.actions import action_cancel
from approvals.services.attempts import route_refusal
from approvals.services.execution import action_execute
from approvals.services.runs import RunNotActive
from audit.models import AuditEvent
from audit.services import Actor
from console.models import KillSwitch
from console.services import kill_switch_set
from engine.core.barrier import apply_action
from engine.core.errors import Forbidden, NotFound, ValidationFailed
from engine.core.fence import next_fence
from engine.core.lock import FencedLock
from engine.core.operations import open_operation
from ownership.models import Resource
from ownership.selectors import conflict_get_for_person

pytestmark = pytest.mark.django_db


def _switch(world: Any, scope: str, *, engaged: bool, reason: str) -> Any:
    """The kill switch on `scope`, set by the world's operator."""
    return kill_switch_set(
        scope=scope, engaged=engaged, reason=reason, actor=Actor.person(world.operator)
    )


def test_only_operators_use_the_kill_switch_and_bad_scopes_are_refused(engine_world: Any) -> None:
    with pytest.raises(Forbidden):
        kill_switch_set(
            scope="*", engaged=True, reason="x", actor=Actor.person(engine_world.outsider)
        )
    with pytest.raises(ValidationFailed):
        _switch(engine_world, "no spaces allowed", engaged=True, reason="x")
    with pytest.raises(ValidationFailed):
        _switch(engine_world, "*", engaged=True, reason="")
    assert not KillSwitch.objects.exists()


def test_engaging_twice_is_a_no_op_and_release_resumes_only_uncovered_work(
    engine_world: Any, engine_redis: Any
) -> None:
    action = engine_world.proposed_create("app-1", {"ip": "1"})
    _switch(engine_world, "*", engaged=True, reason="freeze")
    _switch(engine_world, "*", engaged=True, reason="freeze")
    assert AuditEvent.objects.filter(event_type="kill_switch.engaged").count() == 1
    _switch(engine_world, "dns-record/app-*", engaged=True, reason="dns")
    _switch(engine_world, "*", engaged=False, reason="")
    action.refresh_from_db()
    assert action.status == "paused"  # still covered by dns-record/app-*
    _switch(engine_world, "dns-record/app-*", engaged=False, reason="")
    action.refresh_from_db()
    assert action.status == "queued" and action.paused_reason == ""
    assert action_execute(action_id=action.pk) == "applied"


def test_a_stale_fence_is_recorded_and_retried_with_a_new_fence(
    engine_world: Any, engine_redis: Any
) -> None:
    action = engine_world.proposed_update("a", {"n": 0}, {"n": 1})
    kind = action.kind
    fence = next_fence()
    operation = open_operation(action_id=action.pk, fence=fence, worker="zombie", lease_seconds=30)
    Resource.objects.filter(kind=kind, name="a").update(last_fence=fence)  # a newer holder's mark
    outcome = apply_action(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=Actor.system()
    )
    assert outcome.refusal is not None and outcome.refusal.reason == "stale_fence"
    assert (
        route_refusal(action_id=action.pk, operation_id=operation.pk, refusal="stale_fence")
        == "retry"
    )
    action.refresh_from_db()
    assert action.status == "queued" and action.attempts == 1
    Action.objects.filter(pk=action.pk).update(not_before=None)
    assert action_execute(action_id=action.pk) == "applied"
    assert AuditEvent.objects.filter(event_type="write.refused", action_id=action.pk).count() == 1


@pytest.mark.parametrize("moved_to", ["applied", "paused"])
def test_a_delivery_that_finds_the_action_moved_on_once_it_holds_the_lock_claims_nothing(
    engine_world: Any, engine_redis: Any, monkeypatch: Any, moved_to: str
) -> None:
    """The action leaves `queued` between the job's first read and its lock (another
    delivery finished it, a kill switch paused it): the claim under the lock refuses it,
    so no operation is opened and the action is not moved."""
    action = engine_world.proposed_update("late", {"n": 0}, {"n": 1})
    kind = action.kind
    real_try_acquire = FencedLock.try_acquire

    def moved_then_acquire(lock: FencedLock) -> bool:
        Action.objects.filter(pk=action.pk).update(status=moved_to)
        return real_try_acquire(lock)

    # The delivery's first step on the lock (a batch claims under locks taken this way).
    monkeypatch.setattr(FencedLock, "try_acquire", moved_then_acquire)
    assert action_execute(action_id=action.pk) == f"skipped:{moved_to}"
    assert Action.objects.values_list("status", flat=True).get(pk=action.pk) == moved_to
    assert not Operation.objects.filter(action=action).exists()
    assert Resource.objects.get(kind=kind, name="late").version == 1


def test_selectors_hide_what_the_actor_may_not_see(engine_world: Any, engine_redis: Any) -> None:
    kind = engine_world.kind("policy", update="replace_shared_document", owner_group="platform")
    engine_world.resource(kind, "p", {"n": 0})
    action = engine_world.propose(kind, "p", payload={"n": 1}, observed_version=1)

    def visible(reader: Any) -> Any:
        return actions_visible_to(reader).filter(pk=action.pk).first()

    assert visible(engine_world.run) == action
    assert visible(engine_world.operator) == action
    platform_member = engine_world.person("pat", "platform")
    assert visible(platform_member) == action
    for stranger in (engine_world.other_run, engine_world.outsider):
        assert visible(stranger) is None
    assert [a.action_id for a in approval_list_for_person(engine_world.operator)] == [action.pk]
    assert not approval_list_for_person(platform_member).exists()
    with pytest.raises(NotFound):
        conflict_get_for_person(engine_world.outsider, "not-a-uuid")


def test_paused_work_whose_switch_disappeared_is_resumed_by_the_reconciler(
    engine_world: Any, engine_redis: Any
) -> None:
    from approvals.services.reconcile import reconcile

    action = engine_world.proposed_create("app-2", {"ip": "2"})
    _switch(engine_world, "dns-record/*", engaged=True, reason="freeze")
    assert reconcile()["resumed"] == 0
    KillSwitch.objects.all().delete()  # e.g. an admin removed the row
    assert reconcile()["resumed"] == 1
    action.refresh_from_db()
    assert action.status == "queued"


def test_action_cancel_decides_who_may_cancel(engine_world: Any) -> None:
    """The rule lives in the service, not in its callers: operators, the agent, and
    its run's token while the run is active."""
    world = engine_world
    action = world.proposed_update("c1", {"v": 1}, {"v": 2})
    owner = world.person("oscar", "owners")  # reads the resource's actions, is no operator
    for person in (owner, world.outsider):
        with pytest.raises(Forbidden):
            action_cancel(action=action, actor=Actor.person(person))
    with pytest.raises(NotFound):
        action_cancel(action=action, actor=Actor.run(world.other_run))
    with pytest.raises(NotFound):
        action_cancel(action=action, actor=Actor.agent(world.other_run.agent))
    Run.objects.filter(pk=world.run.pk).update(status="revoked")
    with pytest.raises(RunNotActive):
        action_cancel(action=action, actor=Actor.run(Run.objects.get(pk=world.run.pk)))
    assert not AuditEvent.objects.filter(event_type="action.cancelled").exists()
    assert action_cancel(action=action, actor=Actor.person(world.operator)).status == "cancelled"
    other = world.propose(action.kind, "c1", payload={"v": 3}, observed_version=1)
    assert action_cancel(action=other, actor=Actor.agent(world.agent)).status == "cancelled"
