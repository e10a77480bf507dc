"""Every partial index is reached by statements that name its predicate without parameters.

The product's statements run prepared (Django's server-side binding prepares one after five
runs; the poll's fast path at once), and after a few runs PostgreSQL may keep one generic plan
for every value. That plan can use a partial index only if the statement states the index's
predicate itself: with the predicate's value as a parameter it cannot, and it read a run's
call approvals (`approval_of_run`) or a resource's whole history (`action_in_flight`) instead.
So each partial index is listed here with the test that checks its statement's generic plan;
a new one fails this test until it has one. (Unique constraints with a condition are not
listed: they enforce, and their lookups go through the foreign key's own index.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connection

from ownership.models import OwnershipRecord

pytestmark = pytest.mark.django_db

TESTS = Path(__file__).parent

# Each partial index, and the test that checks the generic plan of the statement that uses it.
PLAN_TESTED = {
    "approval_of_run": "test_api_poll_run_approvals.py",
    "action_in_flight": "test_perf_in_flight_writes.py",
}
# A boolean column's index: Django compiles `active=True` to the bare column, no parameter
# (checked below), so every plan can use it.
BARE_BOOLEAN = {"ownership_active_idx"}
# Predicates with no value in them (IS NULL, a column against a column): the statements below
# state them literally, so a generic plan can use the index too (checked below).
NO_VALUE_PREDICATE = {"grant_live", "action_granted"}


def _partial_indexes() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND i.indpred IS NOT NULL AND NOT i.indisunique"
        )
        return {name for (name,) in cursor.fetchall()}


def test_every_partial_index_has_a_generic_plan_test() -> None:
    assert _partial_indexes() == set(PLAN_TESTED) | BARE_BOOLEAN | NO_VALUE_PREDICATE
    for index, test_file in PLAN_TESTED.items():
        text = (TESTS / test_file).read_text()
        assert index in text and "generic" in text, (index, test_file)


def test_the_active_ownership_filter_names_its_column_without_a_parameter() -> None:
    sql, params = OwnershipRecord.objects.filter(kind_id="k", active=True).query.sql_with_params()
    assert params == ("k",), params
    assert '"ownership_ownershiprecord"."active" AND' in sql, sql


def test_the_grant_indexes_predicates_are_stated_without_a_parameter() -> None:
    from datetime import UTC, datetime

    from approvals.models import Action
    from approvals.services import grants

    use = grants._use_sql()
    assert "revoked_at IS NULL AND used < uses" in use, use  # grant_live's predicate
    since = datetime(2026, 1, 1, tzinfo=UTC)
    sql, params = Action.objects.filter(
        grant__isnull=False, created_at__gte=since
    ).query.sql_with_params()
    assert '"grant_id" IS NOT NULL' in sql and params == (since,), (sql, params)
