"""The write barrier: one conditional UPDATE per write, refusals recorded, nothing lost."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction

from approvals.models import Action, ActionStatus, Operation, OperationStatus
from audit.models import AuditEvent
from audit.services import Actor
from audit.verify import verify_chain
from console.models import KillSwitch
from engine.core.barrier import apply_action
from engine.core.errors import InvalidTransition, KillSwitchEngaged
from engine.core.fence import next_fence
from engine.core.operations import open_operation
from ownership.diff import apply_merge_patch, proposed_document
from ownership.models import Resource, ResourceVersion
from tests.fixtures.core import execute, make_action, make_resource, make_run, prod_alerts_action
from tests.races import Holder

PROD_ALERTS = "notification-policy/prod-alerts"
# The barrier is SQL: all but the merge-patch table test reach the database.
pytestmark = pytest.mark.django_db


def test_the_design_collision_refuses_the_stale_full_document_write(prod_alerts: Any) -> None:
    run_a = make_run("agent-a", task="add a backup destination")
    run_b = make_run("agent-b", task="raise severity")
    seen_by_a = Resource.objects.get(pk=prod_alerts.pk)
    assert seen_by_a.version == 41

    # B patches severity -> critical, observed 41 -> 42.
    action_b = prod_alerts_action(
        run_b, payload={"severity": "critical"}, payload_format="merge_patch"
    )
    outcome_b = execute(action_b)
    assert outcome_b.applied and outcome_b.result_version == 42

    # A sends the full document it read at 41, plus its own change.
    document_a = {**seen_by_a.document, "channels": ["email", "backup-pager"]}
    action_a = prod_alerts_action(run_a, payload=document_a)
    outcome_a = execute(action_a)

    assert not outcome_a.applied
    assert outcome_a.refusal is not None
    assert outcome_a.refusal.reason == "stale_version"
    assert outcome_a.refusal.expected_version == 41
    assert outcome_a.refusal.current_version == 42

    resource = Resource.objects.get(pk=prod_alerts.pk)
    assert resource.version == 42
    assert resource.document == {
        "severity": "critical",
        "channels": ["email"],
        "escalation": {"after_minutes": 15},
    }
    assert Operation.objects.get(pk=outcome_a.operation_id).status == OperationStatus.FAILED
    assert Operation.objects.get(pk=outcome_a.operation_id).outcome["current_version"] == 42
    assert Action.objects.get(pk=action_b.pk).status == ActionStatus.APPLIED
    # The engine routes the refused action; the barrier leaves it executing.
    assert Action.objects.get(pk=action_a.pk).status == ActionStatus.EXECUTING

    applied = AuditEvent.objects.get(event_type="write.applied", action_id=action_b.pk)
    refused = AuditEvent.objects.get(event_type="write.refused", action_id=action_a.pk)
    assert (applied.run_id, applied.actor_type, applied.actor_id) == (
        run_b.pk,
        "run",
        str(run_b.pk),
    )
    assert applied.details["from_version"] == "41" and applied.details["to_version"] == "42"
    assert applied.details["fence"] == outcome_b.fence
    assert (refused.run_id, refused.actor_id) == (run_a.pk, str(run_a.pk))
    assert refused.details["expected_version"] == 41
    assert refused.details["current_version"] == 42
    assert refused.details["reason"] == "stale_version"
    assert refused.seq > applied.seq
    assert verify_chain().ok


def test_an_accepted_write_records_version_operation_and_deadline(prod_alerts: Any) -> None:
    run = make_run()
    action = prod_alerts_action(run, payload={"severity": "info"}, payload_format="merge_patch")
    outcome = execute(action)
    version = ResourceVersion.objects.get(resource=prod_alerts, version=42)
    assert version.document["severity"] == "info"
    assert (version.fence, version.run_id, version.action_id) == (outcome.fence, run.pk, action.pk)
    assert version.operation == "update"
    operation = Operation.objects.get(pk=outcome.operation_id)
    assert operation.status == OperationStatus.DONE
    assert (operation.base_version, operation.result_version) == ("41", "42")
    # replace_shared_document's window is 600 s.
    window = (operation.undo_deadline - operation.finished_at).total_seconds()
    assert 599 <= window <= 601
    action.refresh_from_db()
    assert action.status == ActionStatus.APPLIED
    assert action.revision == 3  # queued(1) -> executing(2) -> applied(3)
    assert action.resource_id == prod_alerts.pk
    assert Resource.objects.get(pk=prod_alerts.pk).last_fence == outcome.fence


def test_a_kind_undo_window_overrides_the_class_window() -> None:
    make_resource("dns-record/www", {"ip": "10.0.0.1"})
    from tests.fixtures.core import make_kind

    make_kind("dns-record", undo_window_seconds=30)
    action = make_action(
        run=make_run(), identifier="dns-record/www", payload={"ip": "10.0.0.2"}, observed_version=1
    )
    outcome = execute(action)
    operation = Operation.objects.get(pk=outcome.operation_id)
    assert 29 <= (operation.undo_deadline - operation.finished_at).total_seconds() <= 31


def test_merge_patch_follows_rfc_7396() -> None:
    target = {"a": "b", "c": {"d": "e", "f": "g"}, "list": [1, 2], "keep": True}
    patch = {"a": "z", "c": {"f": None, "new": 1}, "list": [3], "absent": None}
    assert apply_merge_patch(target, patch) == {
        "a": "z",
        "c": {"d": "e", "new": 1},
        "list": [3],
        "keep": True,
    }
    # RFC 7396 appendix examples.
    assert apply_merge_patch({"a": ["b"]}, {"a": "c"}) == {"a": "c"}
    assert apply_merge_patch({"a": "foo"}, "bar") == "bar"
    assert apply_merge_patch({"e": None}, {"a": 1}) == {"e": None, "a": 1}
    assert apply_merge_patch([1, 2], {"a": "b", "c": None}) == {"a": "b"}
    assert apply_merge_patch({}, {"a": {"bb": {"ccc": None}}}) == {"a": {"bb": {}}}
    assert target["c"] == {"d": "e", "f": "g"}  # the input is not mutated


def test_a_merge_patch_is_applied_to_the_current_document(prod_alerts: Any) -> None:
    action = prod_alerts_action(
        make_run(),
        payload={"escalation": {"after_minutes": None, "to": "oncall"}, "channels": None},
        payload_format="merge_patch",
    )
    assert execute(action).applied
    assert Resource.objects.get(pk=prod_alerts.pk).document == {
        "severity": "warning",
        "escalation": {"to": "oncall"},
    }


def test_a_delete_proposes_the_empty_document_while_its_tombstone_keeps_the_last_one() -> None:
    make_resource("dns-record/gone", {"ip": "10.0.0.9"}, version=3)
    delete = make_action(
        run=make_run(), identifier="dns-record/gone", operation="delete", observed_version=3
    )
    # The one proposal rule (inbox, approvals API, conflicts): a delete leaves nothing.
    assert proposed_document(delete, {"ip": "10.0.0.9"}) == {}
    assert execute(delete).applied
    # What the barrier stores is a separate concern: the tombstone keeps what was deleted.
    resource = Resource.objects.get(kind_id="dns-record", name="gone")
    assert resource.deleted and resource.document == {"ip": "10.0.0.9"}
    history = ResourceVersion.objects.get(resource=resource, version=4)
    assert history.deleted and history.document == {"ip": "10.0.0.9"}


def test_delete_leaves_a_tombstone_and_create_revives_it() -> None:
    make_resource("dns-record/old", {"ip": "10.0.0.9"}, version=3)
    run = make_run()
    delete = make_action(
        run=run, identifier="dns-record/old", operation="delete", observed_version=3
    )
    outcome = execute(delete)
    assert outcome.applied and outcome.result_version == 4
    resource = Resource.objects.get(kind_id="dns-record", name="old")
    assert resource.deleted and resource.version == 4
    assert ResourceVersion.objects.get(resource=resource, version=4).deleted

    # An update of a tombstone is refused as missing.
    update = make_action(
        run=run, identifier="dns-record/old", payload={"ip": "1.1.1.1"}, observed_version=4
    )
    refused = execute(update)
    assert not refused.applied and refused.reason == "missing"

    # A create of the same name revives it; versions keep rising.
    create = make_action(
        run=run, identifier="dns-record/old", operation="create", payload={"ip": "10.0.0.10"}
    )
    revived = execute(create)
    assert revived.applied and (revived.base_version, revived.result_version) == (4, 5)
    resource.refresh_from_db()
    assert not resource.deleted and resource.document == {"ip": "10.0.0.10"}


def test_create_of_an_existing_name_is_refused() -> None:
    make_resource("dns-record/taken", {"ip": "10.0.0.1"})
    action = make_action(
        run=make_run(), identifier="dns-record/taken", operation="create", payload={"ip": "x"}
    )
    outcome = execute(action)
    assert not outcome.applied and outcome.reason == "already_exists"
    assert Resource.objects.get(kind_id="dns-record", name="taken").document == {"ip": "10.0.0.1"}


def test_update_of_a_missing_resource_is_refused() -> None:
    from tests.fixtures.core import make_kind

    make_kind("dns-record")
    action = make_action(
        run=make_run(), identifier="dns-record/nowhere", payload={}, observed_version=1
    )
    outcome = execute(action)
    assert not outcome.applied and outcome.reason == "missing"
    assert AuditEvent.objects.filter(event_type="write.refused", action_id=action.pk).exists()


def test_the_kill_switch_is_checked_inside_the_barrier(prod_alerts: Any) -> None:
    run = make_run()
    action = prod_alerts_action(run, payload={"severity": "x"})
    fence = next_fence()
    operation = open_operation(action_id=action.pk, fence=fence, worker="w", lease_seconds=60)
    # Engaged after the job started (after open_operation): the barrier still refuses.
    KillSwitch.objects.create(scope="notification-policy/prod-*", engaged=True, reason="incident")
    events_before = AuditEvent.objects.count()
    with pytest.raises(KillSwitchEngaged) as raised:
        apply_action(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=Actor.run(run)
        )
    assert raised.value.extra["scope"] == "notification-policy/prod-*"
    assert Resource.objects.get(pk=prod_alerts.pk).version == 41
    assert Operation.objects.get(pk=operation.pk).status == OperationStatus.PENDING
    assert AuditEvent.objects.count() == events_before

    # Other namespaces are not affected; a global switch covers everything.
    other = make_resource("dns-record/a", {})
    other_action = make_action(run=run, identifier="dns-record/a", payload={}, observed_version=1)
    assert execute(other_action).applied
    KillSwitch.objects.create(scope="*", engaged=True, reason="all stop")
    another = make_action(run=run, identifier="dns-record/a", payload={"b": 1}, observed_version=2)
    with pytest.raises(KillSwitchEngaged):
        execute(another)
    assert Resource.objects.get(pk=other.pk).version == 2

    # Released: the same operation goes through.
    KillSwitch.objects.update(engaged=False)
    outcome = apply_action(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=Actor.run(run)
    )
    assert outcome.applied and outcome.result_version == 42


def test_a_redelivered_operation_writes_nothing_twice(prod_alerts: Any) -> None:
    run = make_run()
    action = prod_alerts_action(run, payload={"severity": "x"})
    first = execute(action)
    operation_id = first.operation_id
    again = apply_action(
        action_id=action.pk, operation_id=operation_id, fence=first.fence, actor=Actor.run(run)
    )
    assert again.applied and again.result_version == 42
    assert Resource.objects.get(pk=prod_alerts.pk).version == 42
    assert AuditEvent.objects.filter(action_id=action.pk).count() == 1
    # A new execution of an applied action is refused before it writes.
    with pytest.raises(InvalidTransition):
        open_operation(action_id=action.pk, fence=next_fence(), worker="w", lease_seconds=60)


def _connect_patiently(seconds: float = 20.0) -> None:
    """Open this thread's connection before the start line. Connection slots are an
    environment precondition (a shared PostgreSQL may be briefly full), not the
    invariant under test, so wait for one rather than fail."""
    import time

    from django.db import OperationalError

    deadline = time.monotonic() + seconds
    while True:
        try:
            connection.ensure_connection()
            return
        except OperationalError:
            connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _race(count: int, target: Any) -> list[Any]:
    """Run `target(index)` in `count` threads released together (each already
    connected, so they collide in the statement under test); collect results."""
    start = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(index: int) -> None:
        try:
            _connect_patiently()
            start.wait(timeout=60)
            results[index] = target(index)
        except BaseException as exc:
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


@pytest.mark.django_db(transaction=True)
def test_fifty_concurrent_writes_of_one_observed_version_apply_exactly_once() -> None:
    resource = make_resource("notification-policy/race", {"n": 0}, version=7)
    run = make_run()
    actions = [
        make_action(
            run=run,
            identifier="notification-policy/race",
            payload={"n": index},
            payload_format="merge_patch",
            observed_version=7,
        )
        for index in range(50)
    ]
    operations = []
    for action in actions:
        fence = next_fence()
        operations.append(
            (
                open_operation(action_id=action.pk, fence=fence, worker="w", lease_seconds=60),
                fence,
            )
        )

    def write(index: int) -> Any:
        operation, fence = operations[index]
        return apply_action(
            action_id=actions[index].pk,
            operation_id=operation.pk,
            fence=fence,
            actor=Actor.run(run),
        )

    results = _race(50, write)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    applied = [r for r in results if r.applied]
    refused = [r for r in results if not r.applied]
    assert len(applied) == 1
    assert len(refused) == 49
    assert {r.reason for r in refused} <= {"stale_version", "stale_fence"}
    winner = applied[0]
    resource.refresh_from_db()
    assert resource.version == 8
    assert resource.last_fence == winner.fence
    assert ResourceVersion.objects.filter(resource=resource).count() == 2
    winner_index = next(i for i, r in enumerate(results) if r.applied)
    assert resource.document == {"n": winner_index}
    assert Operation.objects.filter(status=OperationStatus.DONE).count() == 1
    assert Operation.objects.filter(status=OperationStatus.FAILED).count() == 49
    assert AuditEvent.objects.filter(event_type="write.applied").count() == 1
    assert AuditEvent.objects.filter(event_type="write.refused").count() == 49
    assert verify_chain().ok


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_creates_of_one_name_leave_one_row() -> None:
    from tests.fixtures.core import make_kind

    make_kind("dns-record")
    run = make_run()
    for attempt in range(3):
        name = f"dns-record/new-{attempt}"
        actions = [
            make_action(run=run, identifier=name, operation="create", payload={"by": index})
            for index in range(2)
        ]
        results = _race(2, lambda index, actions=actions: execute(actions[index]))
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert sorted(r.applied for r in results) == [False, True]
        loser = next(r for r in results if not r.applied)
        assert loser.reason in {"already_exists", "stale_fence"}
        assert Resource.objects.filter(kind_id="dns-record", name=name.split("/")[1]).count() == 1
    assert verify_chain().ok


def test_open_operation_claims_only_executable_actions(prod_alerts: Any) -> None:
    import uuid

    from engine.core.errors import NotFound

    run = make_run()
    waiting = prod_alerts_action(run, payload={}, status="pending_approval")
    with pytest.raises(InvalidTransition):
        open_operation(action_id=waiting.pk, fence=next_fence(), worker="w", lease_seconds=60)
    with pytest.raises(NotFound):
        open_operation(action_id=uuid.uuid4(), fence=next_fence(), worker="w", lease_seconds=60)
    paused = prod_alerts_action(run, payload={}, status="paused")
    operation = open_operation(
        action_id=paused.pk, fence=next_fence(), worker="w", lease_seconds=60
    )
    assert operation.status == OperationStatus.PENDING and operation.lease_expires_at
    paused.refresh_from_db()
    assert paused.status == ActionStatus.EXECUTING and paused.revision == 2


def test_a_write_executed_by_a_worker_is_attributed_to_its_run(prod_alerts: Any) -> None:
    run = make_run("deploy-bot")
    action = prod_alerts_action(run, payload={})
    fence = next_fence()
    operation = open_operation(action_id=action.pk, fence=fence, worker="w", lease_seconds=60)
    apply_action(
        action_id=action.pk,
        operation_id=operation.pk,
        fence=fence,
        actor=Actor.system("worker"),
    )
    event = AuditEvent.objects.get(event_type="write.applied")
    assert (event.actor_type, event.actor_id, event.run_id) == ("run", str(run.pk), run.pk)
    assert event.actor_label.startswith("deploy-bot/")
    assert event.details["executor"] == {"type": "system", "id": "", "label": "worker"}


def test_an_operation_closed_by_the_reconciler_never_writes(prod_alerts: Any) -> None:
    run = make_run()
    action = prod_alerts_action(run, payload={"severity": "x"})
    fence = next_fence()
    operation = open_operation(action_id=action.pk, fence=fence, worker="w", lease_seconds=60)
    # A reconciler gave up on the (apparently dead) worker and closed the operation.
    Operation.objects.filter(pk=operation.pk).update(
        status=OperationStatus.FAILED, outcome={"reason": "lease_expired"}
    )
    outcome = apply_action(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=Actor.run(run)
    )
    assert not outcome.applied and outcome.reason == "operation_not_pending"
    assert Resource.objects.get(pk=prod_alerts.pk).version == 41
    assert not AuditEvent.objects.filter(action_id=action.pk).exists()


def test_engaged_switch_for_matches_global_prefix_and_exact_scopes() -> None:
    from engine.core.killswitch import engaged_switch_for

    assert engaged_switch_for("dns-record/www") is None
    KillSwitch.objects.create(scope="dns-record/www", engaged=True, reason="exact")
    KillSwitch.objects.create(scope="dns-record/staging-*", engaged=True, reason="prefix")
    KillSwitch.objects.create(scope="notification-policy/*", engaged=False, reason="released")
    assert engaged_switch_for("dns-record/www").reason == "exact"  # type: ignore[union-attr]
    assert engaged_switch_for("dns-record/www2") is None
    assert engaged_switch_for("dns-record/staging-eu").reason == "prefix"  # type: ignore[union-attr]
    assert engaged_switch_for("notification-policy/prod-alerts") is None
    KillSwitch.objects.create(scope="*", engaged=True, reason="everything")
    # The broadest engaged switch is the one reported.
    assert engaged_switch_for("dns-record/www").reason == "everything"  # type: ignore[union-attr]
    assert engaged_switch_for("anything/else").scope == "*"  # type: ignore[union-attr]


@pytest.mark.django_db(transaction=True)  # the claim must run in autocommit, as a job's does
def test_the_claim_commits_unflushed_only_in_its_own_transaction(prod_alerts: Any) -> None:
    """open_operation's claim is one statement: alone (autocommit) it turns the flush wait
    off for its own commit only (set_config(..., true)), and inside a caller's transaction
    it leaves the caller's commit alone."""

    def synchronous_commit() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            return str(cursor.fetchone()[0])

    run = make_run()
    alone = prod_alerts_action(run, payload={"a": 1})
    open_operation(action_id=alone.pk, fence=next_fence(), worker="w", lease_seconds=60)
    assert synchronous_commit() == "on"  # nothing left behind on the connection
    inside = prod_alerts_action(run, payload={"b": 1})
    with transaction.atomic():
        open_operation(action_id=inside.pk, fence=next_fence(), worker="w", lease_seconds=60)
        assert synchronous_commit() == "on"
    assert Action.objects.get(pk=inside.pk).status == ActionStatus.EXECUTING


@pytest.mark.django_db(transaction=True)
def test_a_lock_wait_that_fails_inside_the_pipelined_locks_is_a_database_error_and_rolls_back(
    prod_alerts: Any,
) -> None:
    """The barrier's locks go to PostgreSQL as one pipeline (write_rows.py): a statement
    of it that fails (here the operation row's lock times out behind another holder) must
    surface as Django's DatabaseError, as an ORM statement's would, leave nothing written
    and the connection usable — and the same operation then applies."""
    run = make_run()
    action = prod_alerts_action(run, payload={"severity": "page"})
    fence = next_fence()
    operation = open_operation(action_id=action.pk, fence=fence, worker="w", lease_seconds=60)
    holder = Holder(lambda: Operation.objects.select_for_update().get(pk=operation.pk)).hold()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
        with pytest.raises(DatabaseError):
            apply_action(
                action_id=action.pk, operation_id=operation.pk, fence=fence, actor=Actor.run(run)
            )
        assert Resource.objects.get(pk=prod_alerts.pk).version == 41
        assert Operation.objects.get(pk=operation.pk).status == OperationStatus.PENDING
        assert not AuditEvent.objects.filter(event_type__startswith="write.").exists()
    finally:
        holder.release()
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    outcome = apply_action(
        action_id=action.pk, operation_id=operation.pk, fence=fence, actor=Actor.run(run)
    )
    assert outcome.applied and outcome.result_version == 42
    assert verify_chain().ok
