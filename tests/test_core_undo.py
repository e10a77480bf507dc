"""Undo: through the same barrier, inside the window, only while nobody wrote since,
once per operation however many times (or however concurrently) it is asked."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from audit.models import AuditEvent
from audit.services import Actor
from audit.verify import verify_chain
from console.models import KillSwitch
from engine.core.errors import KillSwitchEngaged
from ownership.models import Resource, ResourceVersion
from tests.fixtures.core import execute, make_action, make_resource, make_run, undo
from tests.test_core_barrier import _race

PROD_ALERTS = "notification-policy/prod-alerts"
ORIGINAL = {"severity": "warning", "channels": ["email"], "escalation": {"after_minutes": 15}}


def _apply_patch(run: Any, patch: dict[str, Any], observed: int) -> Any:
    action = make_action(
        run=run,
        identifier=PROD_ALERTS,
        payload=patch,
        payload_format="merge_patch",
        observed_version=observed,
    )
    outcome = execute(action)
    assert outcome.applied
    return outcome


@pytest.mark.django_db
def test_undo_inside_the_window_restores_the_previous_document(prod_alerts: Any) -> None:
    run = make_run()
    written = _apply_patch(run, {"severity": "critical"}, 41)
    outcome = undo(written.operation_id)

    assert outcome.applied
    assert (outcome.restored_version, outcome.result_version) == ("41", "43")
    resource = Resource.objects.get(pk=prod_alerts.pk)
    assert resource.document == ORIGINAL
    assert resource.version == 43
    assert resource.last_fence == outcome.fence
    snapshot = ResourceVersion.objects.get(resource=resource, version=43)
    assert snapshot.operation == "undo" and snapshot.document == ORIGINAL
    assert Operation.objects.get(pk=written.operation_id).status == OperationStatus.UNDONE
    undo_op = Operation.objects.get(pk=outcome.undo_operation_id)
    assert undo_op.status == OperationStatus.DONE and undo_op.undo_of_id == written.operation_id
    action = Action.objects.get(pk=written.action_id)
    assert action.status == ActionStatus.UNDONE and action.revision == 4
    event = AuditEvent.objects.get(event_type="write.undone")
    assert event.details["from_version"] == "42" and event.details["to_version"] == "43"
    assert event.run_id == run.pk
    assert verify_chain().ok


@pytest.mark.django_db
def test_asking_again_answers_already_undone_and_writes_nothing(prod_alerts: Any) -> None:
    written = _apply_patch(make_run(), {"severity": "critical"}, 41)
    assert undo(written.operation_id).applied
    events = AuditEvent.objects.count()
    again = undo(written.operation_id)
    assert not again.applied and again.reason == "already_undone"
    assert Resource.objects.get(pk=prod_alerts.pk).version == 43
    assert AuditEvent.objects.count() == events
    assert Operation.objects.filter(undo_of_id=written.operation_id).count() == 1


@pytest.mark.django_db
def test_undo_after_another_write_is_refused_as_resource_moved(prod_alerts: Any) -> None:
    run = make_run()
    written = _apply_patch(run, {"severity": "critical"}, 41)
    _apply_patch(make_run("agent-b"), {"channels": ["sms"]}, 42)

    outcome = undo(written.operation_id)
    assert not outcome.applied
    assert outcome.reason == "resource_moved"
    assert (outcome.expected_version, outcome.current_version) == ("42", "43")
    resource = Resource.objects.get(pk=prod_alerts.pk)
    assert resource.version == 43 and resource.document["channels"] == ["sms"]
    assert Operation.objects.get(pk=written.operation_id).status == OperationStatus.DONE
    assert Action.objects.get(pk=written.action_id).status == ActionStatus.APPLIED
    assert Operation.objects.get(pk=outcome.undo_operation_id).status == OperationStatus.FAILED
    refused = AuditEvent.objects.get(event_type="write.undo_refused")
    assert refused.details["reason"] == "resource_moved"
    # Still once per operation: asking again repeats the recorded refusal.
    assert undo(written.operation_id).reason == "resource_moved"
    assert AuditEvent.objects.filter(event_type="write.undo_refused").count() == 1


@pytest.mark.django_db
def test_undo_after_the_deadline_is_refused(prod_alerts: Any) -> None:
    written = _apply_patch(make_run(), {"severity": "critical"}, 41)
    Operation.objects.filter(pk=written.operation_id).update(
        undo_deadline=timezone.now() - timedelta(seconds=1)
    )
    outcome = undo(written.operation_id)
    assert not outcome.applied and outcome.reason == "window_expired"
    resource = Resource.objects.get(pk=prod_alerts.pk)
    assert resource.version == 42 and resource.document["severity"] == "critical"


@pytest.mark.django_db
def test_undo_of_a_create_leaves_a_tombstone_and_undo_of_a_delete_revives() -> None:
    from tests.fixtures.core import make_kind

    make_kind("dns-record")
    run = make_run()
    create = make_action(
        run=run, identifier="dns-record/fresh", operation="create", payload={"ip": "10.1.1.1"}
    )
    created = execute(create)
    assert created.applied and created.base_version is None
    assert undo(created.operation_id).applied
    resource = Resource.objects.get(kind_id="dns-record", name="fresh")
    assert resource.deleted and resource.version == 2

    make_resource("dns-record/doomed", {"ip": "10.2.2.2"}, version=9)
    delete = make_action(
        run=run, identifier="dns-record/doomed", operation="delete", observed_version=9
    )
    deleted = execute(delete)
    assert deleted.applied
    assert undo(deleted.operation_id).applied
    revived = Resource.objects.get(kind_id="dns-record", name="doomed")
    assert not revived.deleted and revived.document == {"ip": "10.2.2.2"}
    assert revived.version == 11


@pytest.mark.django_db
def test_undo_waits_while_the_kill_switch_is_engaged(prod_alerts: Any) -> None:
    written = _apply_patch(make_run(), {"severity": "critical"}, 41)
    KillSwitch.objects.create(scope="*", engaged=True, reason="freeze")
    with pytest.raises(KillSwitchEngaged):
        undo(written.operation_id)
    assert Resource.objects.get(pk=prod_alerts.pk).version == 42
    pending = Operation.objects.get(undo_of_id=written.operation_id)
    assert pending.status == OperationStatus.PENDING
    KillSwitch.objects.update(engaged=False)
    assert undo(written.operation_id).applied  # the same undo operation, a newer fence
    assert Operation.objects.filter(undo_of_id=written.operation_id).count() == 1


@pytest.mark.django_db
def test_a_person_undo_is_attributed_to_the_person(prod_alerts: Any) -> None:
    from django.contrib.auth import get_user_model

    ana = get_user_model().objects.create_user("ana")
    written = _apply_patch(make_run(), {"severity": "critical"}, 41)
    assert undo(written.operation_id, actor=Actor.person(ana)).applied
    assert ResourceVersion.objects.get(resource=prod_alerts, version=43).person_id == ana.pk
    event = AuditEvent.objects.get(event_type="write.undone")
    assert (event.actor_type, event.actor_label) == ("person", "ana")


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_undos_apply_exactly_once() -> None:
    make_resource(PROD_ALERTS, ORIGINAL, version=41)
    for attempt in range(3):
        written = _apply_patch(
            make_run(f"undo-{attempt}"), {"severity": f"s{attempt}"}, 41 + 2 * attempt
        )
        original = Operation.objects.get(pk=written.operation_id)

        def ask(index: int, original: Operation = original) -> Any:
            return undo(original.pk, actor=Actor.system("test"), worker=f"undo-{index}")

        results = _race(2, ask)
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert sorted(r.applied for r in results) == [False, True]
        loser = next(r for r in results if not r.applied)
        assert loser.reason in {"already_undone", "stale_fence"}
        resource = Resource.objects.get(kind_id="notification-policy", name="prod-alerts")
        assert resource.document == ORIGINAL
        assert resource.version == 41 + 2 * attempt + 2
        assert Operation.objects.filter(undo_of_id=original.pk).count() == 1
        assert (
            AuditEvent.objects.filter(
                event_type="write.undone", details__operation_id=original.pk
            ).count()
            == 1
        )
    assert verify_chain().ok


@pytest.mark.django_db
def test_undo_of_a_refused_write_is_refused_as_not_applied(prod_alerts: Any) -> None:
    run = make_run()
    _apply_patch(run, {"severity": "critical"}, 41)
    stale = make_action(run=run, identifier=PROD_ALERTS, payload={}, observed_version=41)
    refused = execute(stale)
    assert not refused.applied
    outcome = undo(refused.operation_id)
    assert not outcome.applied and outcome.reason == "not_applied"
    assert Resource.objects.get(pk=prod_alerts.pk).version == 42


@pytest.mark.django_db
def test_undo_without_a_recorded_previous_version_is_refused_cleanly() -> None:
    from tests.fixtures.core import make_kind

    make_kind("dns-record")
    kind_resource = Resource.objects.create(
        kind_id="dns-record", name="bare", document={"ip": "1"}, version=3, owner_group="x"
    )
    action = make_action(
        run=make_run(), identifier="dns-record/bare", payload={"ip": "2"}, observed_version=3
    )
    written = execute(action)
    assert written.applied
    outcome = undo(written.operation_id)
    assert not outcome.applied and outcome.reason == "no_previous_version"
    assert Resource.objects.get(pk=kind_resource.pk).document == {"ip": "2"}
