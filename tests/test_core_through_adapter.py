"""Issue 39's last gap: the barrier, undo and the drain reach Airlock's own store only through
its adapter (engine/core/managed_target.py) — and the single write still costs what it did:
its UPDATE, its records and its audit append in one round trip, the UPDATE and the records
in one statement. Statement counts are pinned here (captured by Django, so a statement the
adapter added would show)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from approvals.models import Operation
from audit.services import Actor
from engine.core.barrier import STALE_FENCE, STALE_VERSION, apply_action
from engine.core.fence import next_fence
from engine.core.managed_target import ManagedTarget
from engine.core.operations import open_operation
from engine.core.undo import RESOURCE_MOVED, apply_undo
from engine.targets.base import (
    Capabilities,
    InTransactionTarget,
    ManyWrite,
    Outcome,
    RestoresByVerbs,
    Snapshot,
    WriteResult,
)
from ownership.models import Resource, ResourceVersion
from ownership.targets import adapter_for_kind, in_caller_transaction
from tests.fixtures.core import make_action, make_kind, make_resource, make_run

pytestmark = pytest.mark.django_db

# apply_action of an update, as Django captures it inside a test's transaction: its savepoint
# and its release (2), the switch lock and the rows locked (one pipelined round trip: 4
# statements), the write with its records (1) and the audit append sent with it (1) — the
# same 8, in the same order, as before the barrier went through the adapter (46455b1).
SINGLE_WRITE_STATEMENTS = 8
# A stale update: the same, plus the read-back of the row, the operation failed and the
# `write.refused` event (46455b1: 11).
MISSED_WRITE_STATEMENTS = 11


def _queued_update(name: str = "a", *, version: int = 1) -> Any:
    make_resource(f"cfg/{name}", {"n": 0}, version=version)
    return make_action(
        run=make_run(), identifier=f"cfg/{name}", payload={"n": 1}, observed_version=version
    )


def _apply(action: Any, fence: int | None = None) -> Any:
    fence = fence if fence is not None else next_fence()
    operation = open_operation(action_id=action.pk, fence=fence, worker="t", lease_seconds=60)
    with CaptureQueriesContext(connection) as queries:
        outcome = apply_action(
            action_id=action.pk, operation_id=operation.pk, fence=fence, actor=Actor.run(action.run)
        )
    return outcome, [q["sql"] for q in queries.captured_queries]


def test_a_single_write_lands_with_its_records_in_one_statement_as_before() -> None:
    make_kind("cfg")
    outcome, statements = _apply(_queued_update())
    assert outcome.applied
    landing = [sql for sql in statements if "UPDATE ownership_resource" in sql]
    assert len(landing) == 1  # one write, carrying the history, the operation and the action
    assert "INSERT INTO ownership_resourceversion" in landing[0]
    assert "UPDATE approvals_operation" in landing[0] and "UPDATE approvals_action" in landing[0]
    assert len(statements) == SINGLE_WRITE_STATEMENTS, statements


def test_a_missed_single_write_is_read_back_once_and_refused_as_before() -> None:
    make_kind("cfg")
    action = _queued_update(version=1)
    Resource.objects.filter(name="a").update(version=2)
    outcome, statements = _apply(action)
    assert outcome.reason == STALE_VERSION
    assert outcome.refusal.current_version == 2 and outcome.refusal.expected_version == 1
    reads = [sql for sql in statements if sql.startswith('SELECT "ownership_resource"')]
    assert len(reads) == 1  # the adapter's read-back; the barrier reads nothing again
    assert len(statements) == MISSED_WRITE_STATEMENTS, statements


def test_a_zombie_fence_is_refused_from_what_the_adapter_read_back() -> None:
    make_kind("cfg")
    action = _queued_update()
    Resource.objects.filter(name="a").update(last_fence=10**12)
    outcome, _ = _apply(action, fence=next_fence())
    assert outcome.reason == STALE_FENCE
    assert outcome.refusal.current_fence == 10**12
    assert Resource.objects.get(name="a").version == 1


class _Recording(ManagedTarget):
    """The managed adapter, noting which of its methods were called."""

    def __init__(self, *, kind_id: str, owner_group: str) -> None:
        super().__init__(kind_id=kind_id, owner_group=owner_group)
        self.calls: list[str] = []

    def restore(self, name: str, document: Any, **kwargs: Any) -> WriteResult:
        self.calls.append(f"restore {name}")
        return super().restore(name, document, **kwargs)


def _undo(action: Any, target: Any) -> Any:
    original = Operation.objects.get(action=action, undo_of__isnull=True)
    fence = next_fence()
    undo_op = open_operation(
        action_id=action.pk, fence=fence, worker="t", lease_seconds=60, undo_of_id=original.pk
    )
    with transaction.atomic():
        return apply_undo(
            operation_id=original.pk,
            undo_operation_id=undo_op.pk,
            fence=fence,
            actor=Actor.run(action.run),
            target=target,
        )


def test_undo_restores_through_the_adapter_it_is_given() -> None:
    kind = make_kind("cfg")
    action = _queued_update()
    assert _apply(action)[0].applied
    target = _Recording(kind_id=kind.pk, owner_group=kind.owner_group)
    outcome = _undo(action, target)
    assert outcome.applied and outcome.result_version == "3"
    assert target.calls == ["restore a"]
    row = Resource.objects.get(name="a")
    assert (row.version, row.document) == (3, {"n": 0})
    assert ResourceVersion.objects.get(resource=row, version=3).operation == "undo"


def test_undo_of_a_delete_revives_the_tombstone_at_its_counter() -> None:
    kind = make_kind("cfg")
    make_resource("cfg/gone", {"n": 5}, version=4)
    action = make_action(
        run=make_run(), identifier="cfg/gone", operation="delete", observed_version=4
    )
    assert _apply(action)[0].applied
    assert Resource.objects.get(name="gone").deleted
    outcome = _undo(action, adapter_for_kind(kind))
    assert outcome.applied and outcome.result_version == "6"
    row = Resource.objects.get(name="gone")
    assert (row.deleted, row.document, row.version) == (False, {"n": 5}, 6)


def test_an_undo_that_finds_a_later_write_reports_the_version_the_adapter_read() -> None:
    kind = make_kind("cfg")
    action = _queued_update()
    assert _apply(action)[0].applied
    Resource.objects.filter(name="a").update(version=7, deleted=True)  # deleted since
    outcome = _undo(action, adapter_for_kind(kind))
    assert outcome.reason == RESOURCE_MOVED
    assert outcome.current_version == "7"  # a tombstone's counter: the store keeps it


def test_write_many_lands_what_matches_and_reads_the_misses_back() -> None:
    kind = make_kind("cfg")
    target = adapter_for_kind(kind)
    assert isinstance(target, InTransactionTarget)
    rows = [make_resource(f"cfg/m{i}", {"i": i}, version=1) for i in range(4)]
    Resource.objects.filter(pk=rows[1].pk).update(version=2)
    Resource.objects.filter(pk=rows[2].pk).update(last_fence=10**12)
    Resource.objects.filter(pk=rows[3].pk).update(deleted=True)
    writes = [ManyWrite(row.pk, "1", {"i": 10}, False) for row in rows]
    fence = next_fence()
    with CaptureQueriesContext(connection) as queries:
        results = target.write_many(writes, fence=fence)
    assert len(queries.captured_queries) == 2  # the UPDATE, and one read-back of the misses
    assert results[rows[0].pk].applied and results[rows[0].pk].version == "2"
    assert results[rows[1].pk].outcome is Outcome.STALE
    assert results[rows[1].pk].held is not None and results[rows[1].pk].held.version == "2"
    assert results[rows[2].pk].outcome is Outcome.FENCED
    assert results[rows[3].pk].outcome is Outcome.STALE
    assert results[rows[3].pk].held is not None and results[rows[3].pk].held.absent
    assert Resource.objects.get(pk=rows[0].pk).document == {"i": 10}


def test_only_airlocks_own_store_writes_in_the_callers_transaction() -> None:
    managed = make_kind("cfg")
    http = make_kind("svc", target_url="http://127.0.0.1:9/")
    assert adapter_for_kind(managed).capabilities.in_caller_transaction
    assert in_caller_transaction(managed) and not in_caller_transaction(http)
    assert not adapter_for_kind(http).capabilities.in_caller_transaction


class _Verbs(RestoresByVerbs):
    """A target that records its calls, to see which verb `RestoresByVerbs.restore` picks."""

    capabilities = Capabilities(holds_fence=False, takes_idempotency_key=False)

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def read(self, name: str) -> Snapshot:
        raise NotImplementedError

    def write(self, name: str, document: Any, *, expected_version: str, **_: Any) -> WriteResult:
        self.calls.append(("write", expected_version))
        return WriteResult(Outcome.APPLIED, version="w")

    def create(self, name: str, document: Any, **_: Any) -> WriteResult:
        self.calls.append(("create", None))
        return WriteResult(Outcome.APPLIED, version="c")

    def delete(self, name: str, *, expected_version: str, **_: Any) -> WriteResult:
        self.calls.append(("delete", expected_version))
        return WriteResult(Outcome.APPLIED)


@pytest.mark.parametrize(
    ("deleted", "on_version", "verb"),
    [
        (True, "v2", ("delete", "v2")),
        (False, None, ("create", None)),
        (False, "v2", ("write", "v2")),
    ],
)
def test_restore_by_verbs_picks_the_verb_that_puts_the_state_back(
    deleted: bool, on_version: str | None, verb: tuple[str, str | None]
) -> None:
    target = _Verbs()
    result = target.restore(
        "x",
        {"a": 1},
        deleted=deleted,
        on_version=on_version,
        fence=1,
        idempotency_key="k",
    )
    assert result.applied and target.calls == [verb]


def test_restoring_absence_over_absence_is_refused_not_blind() -> None:
    result = _Verbs().restore(
        "x",
        None,
        deleted=True,
        on_version=None,
        fence=1,
        idempotency_key="k",
    )
    assert result.outcome is Outcome.FAILED
