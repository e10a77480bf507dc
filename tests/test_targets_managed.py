"""Airlock's own store as a target adapter (engine/core/managed_target.py), against the real
PostgreSQL: the same contract the other adapters' tests check (tests/test_targets_postgres.py)
— reads, conditional write/create/delete on the version, the collision, fencing, versions as
strings — plus what only this adapter promises: it writes inside the caller's transaction, so
a rollback there takes the write back with it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, transaction

from engine.core.managed_target import ManagedTarget
from engine.targets.base import (
    ABSENT,
    Applied,
    Conflict,
    NotApplied,
    Outcome,
    TargetAdapter,
    settle_by_reading,
)
from ownership.models import Resource, TargetType
from ownership.targets import adapter_for_kind, current_state
from tests.fixtures.core import make_kind, make_resource

pytestmark = pytest.mark.django_db
KEY = "idem-1"


def _adapter() -> ManagedTarget:
    adapter = adapter_for_kind(make_kind("managed-contract"))
    assert isinstance(adapter, ManagedTarget)
    return adapter


def _row(name: str) -> Resource:
    return Resource.objects.get(kind__slug="managed-contract", name=name)


def test_a_managed_kind_gets_the_managed_adapter_which_speaks_the_interface() -> None:
    kind = make_kind("managed-contract")
    assert kind.target == TargetType.MANAGED
    adapter = adapter_for_kind(kind)
    assert isinstance(adapter, TargetAdapter)
    assert adapter.capabilities.holds_fence is True
    assert adapter.capabilities.takes_idempotency_key is False


def test_read_gives_the_document_and_the_counter_as_text() -> None:
    adapter = _adapter()
    make_resource("managed-contract/a", {"seats": 3}, version=41)
    snapshot = adapter.read("a")
    assert snapshot.document == {"seats": 3}
    assert snapshot.version == "41" and isinstance(snapshot.version, str)
    assert adapter.read("nobody") == ABSENT


def test_two_writers_from_the_same_version_one_applies_the_other_is_stale() -> None:
    adapter = _adapter()
    make_resource("managed-contract/a", {"seats": 3}, version=41)

    first = adapter.write("a", {"seats": 4}, expected_version="41", fence=5, idempotency_key=KEY)
    second = adapter.write("a", {"seats": 9}, expected_version="41", fence=6, idempotency_key=KEY)

    assert first.outcome is Outcome.APPLIED and first.version == "42"
    assert second.outcome is Outcome.STALE
    assert second.current is not None
    assert second.current.document == {"seats": 4} and second.current.version == "42"
    row = _row("a")
    assert (row.document, row.version, row.last_fence) == ({"seats": 4}, 42, 5)


def test_a_version_that_is_not_the_counters_text_never_matches() -> None:
    adapter = _adapter()
    make_resource("managed-contract/a", {"seats": 3}, version=41)
    for version in ("041", " 41", "41.0", "W/41", ""):
        result = adapter.write(
            "a", {"x": 1}, expected_version=version, fence=5, idempotency_key=KEY
        )
        assert result.outcome is Outcome.STALE, version
    assert _row("a").version == 41


def test_an_older_fence_is_refused_even_on_the_current_version_and_nothing_is_written() -> None:
    adapter = _adapter()
    make_resource("managed-contract/a", {"seats": 3}, version=41)
    first = adapter.write("a", {"seats": 4}, expected_version="41", fence=7, idempotency_key=KEY)
    assert first.applied

    # The barrier's rule: a fence not newer than the row's last one never writes.
    for fence in (7, 3):
        for result in (
            adapter.write(
                "a", {"seats": 0}, expected_version="42", fence=fence, idempotency_key=KEY
            ),
            adapter.delete("a", expected_version="42", fence=fence, idempotency_key=KEY),
        ):
            assert result.outcome is Outcome.FENCED
            assert result.current is not None and result.current.version == "42"
    row = _row("a")
    assert (row.document, row.version, row.last_fence, row.deleted) == ({"seats": 4}, 42, 7, False)


def test_delete_is_conditional_on_the_version_and_leaves_a_tombstone() -> None:
    adapter = _adapter()
    make_resource("managed-contract/a", {"seats": 3}, version=41)

    stale = adapter.delete("a", expected_version="40", fence=5, idempotency_key=KEY)
    assert stale.outcome is Outcome.STALE and stale.current is not None
    assert stale.current.version == "41"

    deleted = adapter.delete("a", expected_version="41", fence=5, idempotency_key=KEY)
    assert deleted.outcome is Outcome.APPLIED and deleted.version is None
    assert adapter.read("a") == ABSENT
    row = _row("a")
    assert (row.deleted, row.version, row.document) == (True, 42, {"seats": 3})

    again = adapter.delete("a", expected_version="42", fence=6, idempotency_key=KEY)
    assert again.outcome is Outcome.STALE and again.current == ABSENT
    gone = adapter.write("a", {"x": 1}, expected_version="42", fence=6, idempotency_key=KEY)
    assert gone.outcome is Outcome.STALE and gone.current == ABSENT


def test_create_inserts_refuses_an_existing_name_and_revives_a_tombstone() -> None:
    adapter = _adapter()
    created = adapter.create("b", {"seats": 1}, fence=5, idempotency_key=KEY)
    assert created.outcome is Outcome.APPLIED and created.version == "1"
    assert adapter.read("b").document == {"seats": 1}
    assert _row("b").owner_group == "platform"  # the kind's owners

    twin = adapter.create("b", {"seats": 2}, fence=6, idempotency_key=KEY)
    assert twin.outcome is Outcome.STALE and twin.current is not None
    assert twin.current.document == {"seats": 1}

    assert adapter.delete("b", expected_version="1", fence=6, idempotency_key=KEY).applied
    zombie = adapter.create("b", {"seats": 7}, fence=5, idempotency_key=KEY)
    assert zombie.outcome is Outcome.FENCED
    revived = adapter.create("b", {"seats": 3}, fence=8, idempotency_key=KEY)
    assert revived.outcome is Outcome.APPLIED and revived.version == "3"
    assert adapter.read("b").document == {"seats": 3}


def test_settle_by_reading_applied_not_applied_and_conflict() -> None:
    adapter = _adapter()
    make_resource("managed-contract/a", {"seats": 3}, version=41)
    assert isinstance(
        settle_by_reading(adapter, "a", written_document={"seats": 4}, observed_version="41"),
        NotApplied,
    )
    adapter.write("a", {"seats": 4}, expected_version="41", fence=5, idempotency_key=KEY)
    settled = settle_by_reading(adapter, "a", written_document={"seats": 4}, observed_version="41")
    assert settled == Applied("42")
    adapter.write("a", {"seats": 5}, expected_version="42", fence=6, idempotency_key=KEY)
    settled = settle_by_reading(adapter, "a", written_document={"seats": 4}, observed_version="41")
    assert isinstance(settled, Conflict)


def test_the_write_belongs_to_the_callers_transaction() -> None:
    """What makes a managed write atomic with Airlock's records: a rollback takes it back."""
    adapter = _adapter()
    make_resource("managed-contract/a", {"seats": 3}, version=41)

    class Abandon(Exception):
        pass

    with pytest.raises(Abandon), transaction.atomic():
        written = adapter.write(
            "a", {"seats": 4}, expected_version="41", fence=5, idempotency_key=KEY
        )
        assert written.applied
        assert adapter.read("a").version == "42"
        raise Abandon
    assert adapter.read("a").version == "41"
    assert _row("a").last_fence == 0


def test_a_conflict_reads_the_current_document_through_the_adapter() -> None:
    kind = make_kind("managed-contract")
    live = make_resource("managed-contract/a", {"seats": 3}, version=41)
    assert current_state(kind, live) == ({"seats": 3}, "41")
    adapter = _adapter()
    adapter.write("a", {"seats": 4}, expected_version="41", fence=5, idempotency_key=KEY)
    # The row object the caller holds is older than the store: the adapter's read wins.
    assert current_state(kind, live) == ({"seats": 4}, "42")
    adapter.delete("a", expected_version="42", fence=6, idempotency_key=KEY)
    live.refresh_from_db()
    assert current_state(kind, live) == ({}, "43")  # absent: `{}`, at the tombstone's token


@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_from_the_same_version_exactly_one_applies() -> None:
    make_resource("managed-contract/c", {"n": 0}, version=10)
    adapter = _adapter()
    count = 8
    start = threading.Barrier(count)
    results: dict[int, Any] = {}

    def write(i: int) -> None:
        try:
            start.wait()
            with transaction.atomic():
                results[i] = adapter.write(
                    "c", {"n": i}, expected_version="10", fence=100 + i, idempotency_key=KEY
                )
        finally:
            connection.close()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    outcomes = sorted(result.outcome for result in results.values())
    applied = [i for i, result in results.items() if result.applied]
    assert len(results) == count and len(applied) == 1, outcomes
    # The losers saw the row at 11: stale (their version) or fenced (a newer fence won first).
    assert set(outcomes) <= {Outcome.APPLIED, Outcome.STALE, Outcome.FENCED}
    row = _row("c")
    assert (row.version, row.document) == (11, {"n": applied[0]})
