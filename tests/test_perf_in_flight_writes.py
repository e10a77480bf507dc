"""Every resource read and every proposal asks which approved writes are in flight on the
resource (`writes_in_flight`). A resource written thousands of times has thousands of
actions: the lookup must find the few in flight by the partial index `action_in_flight`, in
the plan PostgreSQL makes for the statement's values and in the generic plan of the prepared
statement (with the statuses as parameters, the partial index was out of that plan's reach
and it read the resource's whole history)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from approvals.models import ActionStatus
from approvals.services.queued_writes import QueuedWrite, in_flight_on, writes_in_flight
from tests.fixtures.core import make_action
from tests.fixtures.query_plans import index_names, plan_nodes, rows_removed_by_filter

pytestmark = pytest.mark.django_db

PAST_WRITES = 3000
RESOURCE = "dns-record/app-1"


def _past_writes(template: Any, count: int) -> None:
    """`count` applied updates of the template's resource, older than it (INSERT … SELECT)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO approvals_action (id, run_id, agent_id, kind_id, name, operation, "
            "payload_format, payload, observed_version, conflict_class_id, status, revision, "
            "reason, idempotency_key, request_id, paused_reason, attempts, created_at, "
            "updated_at) SELECT gen_random_uuid(), %(run)s, %(agent)s, %(kind)s, %(name)s, "
            "'update', 'merge_patch', '{}'::jsonb, g, %(cls)s, 'applied', 3, '', '', '', '', "
            "1, now() - g * interval '1 second', now() FROM generate_series(1, %(count)s) g",
            {
                "run": template.run_id,
                "agent": template.agent_id,
                "kind": template.kind_id,
                "name": template.name,
                "cls": template.conflict_class_id,
                "count": count,
            },
        )
        cursor.execute("ANALYZE approvals_action")


@pytest.mark.parametrize("plan", ["custom", "generic"])
def test_the_writes_in_flight_are_found_by_index_among_thousands_of_past_writes(
    run: Any, plan: str
) -> None:
    queued = make_action(
        run=run.run, identifier=RESOURCE, observed_version=PAST_WRITES + 1, status="queued"
    )
    executing = make_action(
        run=run.run, identifier=RESOURCE, observed_version=PAST_WRITES, status="executing"
    )
    make_action(
        run=run.run, identifier=RESOURCE, observed_version=1, status=ActionStatus.PENDING_APPROVAL
    )
    _past_writes(queued, PAST_WRITES)
    kind, name = RESOURCE.split("/")

    assert writes_in_flight(kind, name) == [
        QueuedWrite(queued.pk, "update", str(PAST_WRITES + 1)),
        QueuedWrite(executing.pk, "update", str(PAST_WRITES)),
    ]
    sql, params = in_flight_on(kind, name).values_list("id").query.sql_with_params()
    nodes = plan_nodes(sql, params, generic=plan == "generic")
    assert "action_in_flight" in index_names(nodes), nodes
    removed = rows_removed_by_filter(nodes)
    assert removed < PAST_WRITES / 10, removed
