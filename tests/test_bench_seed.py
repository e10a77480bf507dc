"""The scale figures' bulk seed (bench/seed.py) leaves a valid chain and the same indexes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection, transaction

from audit.chain import GENESIS_HASH, event_hash, hashed_fields
from audit.models import AuditEvent
from audit.services import Actor, audit_append
from audit.verify import verify_chain
from bench import seed
from tests.fixtures.core import make_resource


def test_the_templated_hash_is_the_chain_hash() -> None:
    text = seed._EventText(datetime(2026, 12, 1, 21, 0, 0, 123456, tzinfo=UTC))
    prev = GENESIS_HASH
    for seq in (1, 9, 10, 99_999, 10_000_000):
        digest = text.digest(seq, prev)
        stored: dict[str, Any] = {"created_at": text.created_at, "actor_type": "system"}
        stored.update(actor_id="", actor_label="bench-seed", request_id="", resource="")
        stored.update(event_type="bench.seed")
        fields = hashed_fields(seq=seq, run_id=None, action_id=None, details={"n": seq}, **stored)
        assert digest == event_hash(fields, prev)
        prev = digest


@pytest.mark.django_db
def test_seeded_events_chain_after_the_head_and_before_the_next_append() -> None:
    audit_append(event_type="test.before", actor=Actor.system("test"))
    with transaction.atomic():
        seed._seed_audit(AuditEvent.objects.count() + 250)
    after = audit_append(event_type="test.after", actor=Actor.system("test"))
    assert verify_chain().ok
    assert after.seq == AuditEvent.objects.count()


def _index_definitions(table: str) -> list[tuple[str, str, str]]:
    with connection.cursor() as cursor:
        cursor.execute(seed._SECONDARY_INDEXES, {"table": table})
        return list(cursor.fetchall())


@pytest.mark.django_db
@pytest.mark.parametrize("table", ["audit_auditevent", "approvals_action", "ownership_resource"])
def test_a_large_load_builds_the_same_indexes_again(table: str) -> None:
    before = _index_definitions(table)
    assert any(kind == "index" for kind, _, _ in before)
    with transaction.atomic(), seed._indexes_rebuilt_after(table, rows=1_000_000):
        assert _index_definitions(table) == []
        # a row with a deferred foreign key check pending, as the load leaves
        make_resource("notification-policy/loaded", {"n": 1})
    assert _index_definitions(table) == before
