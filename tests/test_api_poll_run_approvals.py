"""An action poll's body names its run's approval (`run_approval`). A run that has proposed
thousands of per-call actions has thousands of approvals: the lookup must find the run's own
approval by an index (`approval_of_run`), not read the run's call approvals one by one —
in the plan PostgreSQL makes for the statement's values, and in the generic plan of the
prepared statement the fast path runs (PostgreSQL switches to it after five runs when it
costs no more: with the subject a parameter, the partial index was out of its reach)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from approvals.api.fastpoll_sql import Statements
from approvals.models import ActionStatus
from console.auth import RUN
from tests.fixtures.core import make_action
from tests.fixtures.query_plans import index_names, plan_nodes, rows_removed_by_filter

pytestmark = pytest.mark.django_db

CALL_APPROVALS = 3000


def _call_approvals(run: Any, template: Any, count: int) -> None:
    """`count` decided per-call actions of `run`, each with its approval (INSERT … SELECT)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "WITH made AS (INSERT INTO approvals_action (id, run_id, agent_id, kind_id, name, "
            "operation, payload_format, payload, conflict_class_id, status, revision, reason, "
            "idempotency_key, request_id, paused_reason, attempts, created_at, updated_at) "
            "SELECT gen_random_uuid(), %(run)s, %(agent)s, %(kind)s, 'call-' || g, 'create', "
            "'merge_patch', '{}'::jsonb, %(cls)s, 'applied', 1, '', '', '', '', 1, now(), now() "
            "FROM generate_series(1, %(count)s) g RETURNING id, created_at) "
            "INSERT INTO approvals_approval (id, subject, run_id, action_id, status, quorum, "
            "expires_at, created_at) SELECT gen_random_uuid(), 'action', %(run)s, made.id, "
            "'approved', 1, now() + interval '1 day', made.created_at FROM made",
            {
                "run": run.pk,
                "agent": run.agent_id,
                "kind": template.kind_id,
                "cls": template.conflict_class_id,
                "count": count,
            },
        )
        cursor.execute("ANALYZE approvals_approval")


@pytest.mark.parametrize("plan", ["custom", "generic"])
def test_the_poll_body_finds_the_run_approval_by_index_among_thousands_of_call_approvals(
    run: Any, plan: str
) -> None:
    polled = make_action(
        run=run.run,
        identifier="dns-record/app-1",
        operation="create",
        payload={"n": 1},
        status=ActionStatus.QUEUED,
    )
    _call_approvals(run.run, polled, CALL_APPROVALS)
    # The run token's statement; the agent token's shares everything after its token lookup.
    nodes = plan_nodes(
        Statements().body_sql[RUN].sql, (run.run.token_prefix, polled.pk), generic=plan == "generic"
    )
    assert "approval_of_run" in index_names(nodes), nodes
    # Nothing in the statement reads the run's call approvals to throw them away.
    removed = rows_removed_by_filter(nodes)
    assert removed < CALL_APPROVALS / 10, removed
