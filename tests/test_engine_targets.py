"""The HTTP target adapter against tests/targetserver.py (a real HTTP server)."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Action, Approval, Operation
from approvals.services.decisions import approval_decide
from approvals.services.execution import action_execute
from audit.models import AuditEvent
from audit.services import Actor
from ownership.models import Conflict
from tests.fixtures.engine import wait_until_due
from tests.targetserver import TargetServer

pytestmark = pytest.mark.django_db


@pytest.fixture
def http_kind(engine_world: Any, engine_redis: Any, target: TargetServer, settings: Any) -> Any:
    settings.AIRLOCK_TARGET_TIMEOUT_SECONDS = 0.5
    return engine_world.kind(
        "ext-policy", update="recompute_field", create="add_unique", target_url=target.url
    )


def _queued_write(
    engine_world: Any,
    http_kind: Any,
    target: TargetServer,
    name: str,
    *,
    fail: tuple[int, ...] = (),
    hang: float = 0.0,
) -> Any:
    """`name` at {"n": 1} on the target and a queued write of {"n": 2} read at version 1;
    the target first answers `fail` (statuses), and answers the first write it applies
    only `hang` seconds later."""
    target.seed(name, {"n": 1})
    target.fail_next(*fail)
    target.hang_after_apply(hang)
    return engine_world.propose(http_kind, name, payload={"n": 2}, observed_version=1)


def test_a_write_to_an_http_target_sends_if_match_key_and_fence(
    engine_world: Any, http_kind: Any, target: TargetServer
) -> None:
    target.seed("prod", {"severity": "high"}, version=4)
    action = engine_world.propose(
        http_kind, "prod", payload={"severity": "low"}, observed_version=4
    )
    assert action_execute(action_id=action.pk) == "applied"
    action.refresh_from_db()
    assert action.status == "applied"
    assert target.documents["prod"] == {
        "version": 5,
        "document": {"severity": "low"},
        "deleted": False,
    }
    [request] = target.requests
    assert request["if_match"] == '"4"' and request["key"] == f"airlock-action-{action.pk}"
    assert request["fence"] == Operation.objects.get(action=action).fence
    assert Operation.objects.get(action=action).result_version == "5"


def test_a_412_from_the_target_becomes_a_conflict(
    engine_world: Any, http_kind: Any, target: TargetServer
) -> None:
    http_kind.class_update_id = "replace_shared_document"
    http_kind.save()
    engine_world.resource(http_kind, "prod", {"severity": "high"}, version=1)  # what the agent read
    target.seed("prod", {"severity": "critical"}, version=2)  # someone wrote at the target
    action = engine_world.propose(
        http_kind, "prod", payload={"severity": "low"}, observed_version=1
    )
    approval_decide(
        approval_id=Approval.objects.get(action=action).pk,
        actor=Actor.person(engine_world.operator),
        decision="approve",
    )
    assert action_execute(action_id=action.pk) == "conflict"
    action.refresh_from_db()
    assert action.error["current_etag"] == '"2"' and action.error["retryable_by_agent"] is False
    conflict = Conflict.objects.get(pk=action.error["conflict_id"])
    assert conflict.current_document == {"severity": "critical"}
    assert conflict.base_document == {"severity": "high"}
    assert [r["change"] for r in conflict.fields] == ["both"]
    assert target.effects == 0


def test_429_then_success_applies_once_with_the_same_key(
    engine_world: Any, http_kind: Any, target: TargetServer
) -> None:
    action = _queued_write(engine_world, http_kind, target, "prod", fail=(429, 503))
    assert action_execute(action_id=action.pk) == "retry"
    action.refresh_from_db()
    assert action.status == "queued" and action.attempts == 1 and action.not_before is not None
    wait_until_due(action)
    assert action_execute(action_id=action.pk) == "retry"
    wait_until_due(action)
    assert action_execute(action_id=action.pk) == "applied"
    assert target.effects == 1
    assert len({r["key"] for r in target.requests}) == 1 and len(target.requests) == 3
    assert (
        AuditEvent.objects.filter(event_type="action.retry_scheduled", action_id=action.pk).count()
        == 2
    )


def test_a_timeout_after_sending_leaves_the_operation_unknown_until_a_replay_settles_it(
    engine_world: Any, http_kind: Any, target: TargetServer
) -> None:
    action = _queued_write(engine_world, http_kind, target, "prod", hang=1.5)
    assert action_execute(action_id=action.pk) == "unknown"
    assert target.effects == 1
    first = Operation.objects.get(action=action)
    assert first.status == "unknown"
    action.refresh_from_db()
    assert action.status == "queued"

    wait_until_due(action)
    assert action_execute(action_id=action.pk) == "applied"
    assert target.effects == 1  # the replay applied nothing new
    first.refresh_from_db()
    assert first.status == "done" and first.outcome["settled_by"] is not None
    assert Operation.objects.filter(action=action, status="done").count() == 1
    assert len({r["key"] for r in target.requests}) == 1 and len(target.requests) == 2
    assert AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).count() == 1


def test_a_failing_target_fails_the_action_after_bounded_attempts(
    engine_world: Any, http_kind: Any, target: TargetServer, settings: Any
) -> None:
    settings.AIRLOCK_MAX_ATTEMPTS = 2
    settings.AIRLOCK_BACKOFF_BASE_SECONDS = 0.05
    action = _queued_write(engine_world, http_kind, target, "prod", fail=(502, 502, 502))
    assert action_execute(action_id=action.pk) == "retry"
    wait_until_due(action)
    action_execute(action_id=action.pk)
    action.refresh_from_db()
    assert action.status == "failed"
    assert action.error == {
        "code": "attempts_exhausted",
        "reason": "target_busy: PUT answered 502",
        "attempts": 2,
    }
    assert target.effects == 0


def test_undo_restores_the_previous_document_at_the_target_conditionally(
    engine_world: Any, http_kind: Any, target: TargetServer
) -> None:
    from approvals.services.undo import action_undo_request, undo_execute
    from ownership.targets import read_through

    target.seed("prod", {"n": 1})
    read_through(http_kind, "prod")  # what the agent read (the API reads through, too)
    action = engine_world.propose(http_kind, "prod", payload={"n": 2}, observed_version="1")
    assert action_execute(action_id=action.pk) == "applied"
    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
    assert undo_execute(undo_operation_id=undo.pk) == "undone"

    assert target.documents["prod"] == {"version": 3, "document": {"n": 1}, "deleted": False}
    undo_request = target.requests[-1]
    assert undo_request["if_match"] == '"2"'  # on the version the write produced
    action.refresh_from_db()
    assert action.status == "undone"
    undo.refresh_from_db()
    assert (undo.status, undo.base_version, undo.result_version) == ("done", "2", "3")
    event = AuditEvent.objects.get(event_type="write.undone", action_id=action.pk)
    assert event.details["to_version"] == "3" and event.details["target"] == "http"


def test_undo_after_someone_else_wrote_at_the_target_is_a_conflict_not_an_overwrite(
    engine_world: Any, http_kind: Any, target: TargetServer
) -> None:
    from approvals.services.undo import action_undo_request, undo_execute
    from ownership.targets import read_through

    target.seed("prod", {"n": 1})
    read_through(http_kind, "prod")
    action = engine_world.propose(http_kind, "prod", payload={"n": 2}, observed_version="1")
    assert action_execute(action_id=action.pk) == "applied"
    target.seed("prod", {"n": 9, "by": "someone"}, version=3)  # a change Airlock did not make
    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
    assert undo_execute(undo_operation_id=undo.pk) == "conflict"

    assert target.documents["prod"]["document"] == {"n": 9, "by": "someone"}  # not overwritten
    conflict = Conflict.objects.get(action=action, origin="undo")
    assert conflict.status == "open"
    assert conflict.base_document == {"n": 2} and conflict.base_version == "2"
    assert conflict.current_document == {"n": 9, "by": "someone"}
    assert conflict.current_version == "3"
    assert conflict.proposed_document == {"n": 1}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_replays_a_timed_out_http_write_with_the_same_key_exactly_once(
    target: TargetServer, hanging_write: Any
) -> None:
    action, worker = hanging_write(2.0, AIRLOCK_TARGET_TIMEOUT_SECONDS="0.5")

    def applied() -> bool:
        return Action.objects.values_list("status", flat=True).get(pk=action.pk) == "applied"

    from tests.fixtures.engine import wait_for

    wait_for(applied, timeout=30)
    assert target.effects == 1, worker.output()
    assert len(target.requests) >= 2 and len({r["key"] for r in target.requests}) == 1
    assert Operation.objects.filter(action=action, status="done").count() == 1
    assert AuditEvent.objects.filter(event_type="write.unknown", action_id=action.pk).count() == 1


def test_423_is_retried_and_409_becomes_a_conflict_routed_by_class(
    engine_world: Any, http_kind: Any, target: TargetServer
) -> None:
    action = _queued_write(engine_world, http_kind, target, "locked", fail=(423,))
    assert action_execute(action_id=action.pk) == "retry"
    wait_until_due(action)
    assert action_execute(action_id=action.pk) == "applied"

    # The dialect's 409 refuses a stale Fencing-Token: with the version still the one we
    # wrote on, this holder was overtaken — it retries under a new fence (never a conflict).
    other = _queued_write(engine_world, http_kind, target, "busy", fail=(409,))
    assert action_execute(action_id=other.pk) == "retry"
    wait_until_due(other)
    assert action_execute(action_id=other.pk) == "applied"
    assert target.effects == 2
