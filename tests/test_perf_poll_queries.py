"""The agents' poll (`GET /api/v1/actions/{id}`) costs one token lookup and one read of
the action, whatever the token and whatever the answer (200 or 304). Query counts, not
timings: the bench measures the speed."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from approvals.models import ActionStatus, Approval, ApprovalSubject
from tests.fixtures.core import make_action

pytestmark = pytest.mark.django_db


def polled(api: Any, url: str, token: str, **headers: str) -> tuple[Any, list[str]]:
    with CaptureQueriesContext(connection) as queries:
        response = api.get(url, token=token, headers=headers)
    return response, [q["sql"] for q in queries.captured_queries]


@pytest.fixture
def pending_action(run: Any) -> Any:
    """An action waiting for its per-call approval: what agents poll most."""
    action = make_action(
        run=run.run,
        identifier="dns-record/app-1",
        operation="create",
        payload={"n": 1},
        status=ActionStatus.PENDING_APPROVAL,
    )
    Approval.objects.create(
        subject=ApprovalSubject.ACTION,
        run=run.run,
        action=action,
        expires_at=action.created_at.replace(year=action.created_at.year + 1),
    )
    return action


@pytest.mark.parametrize("who", ["run", "agent"])
def test_it_answers_an_agents_poll_with_one_token_lookup_and_one_read(
    api: Any, run: Any, agent: Any, pending_action: Any, who: str
) -> None:
    token = run.token if who == "run" else agent.token
    url = f"/api/v1/actions/{pending_action.pk}"
    api.get(url, token=token)  # the agent token's last_used write (once a minute) first
    response, queries = polled(api, url, token)
    assert response.status_code == 200
    assert response.json()["approval"]["mode"] == "per_call"
    assert len(queries) == 2, queries
    assert not any(q.lstrip().upper().startswith(("UPDATE", "INSERT")) for q in queries)


def test_it_answers_a_matching_if_none_match_with_304_after_two_reads(
    api: Any, run: Any, pending_action: Any
) -> None:
    url = f"/api/v1/actions/{pending_action.pk}"
    etag = api.get(url, token=run.token).headers["ETag"]
    response, queries = polled(api, url, run.token, **{"If-None-Match": etag})
    assert response.status_code == 304
    assert response.content == b""
    assert len(queries) == 2, queries
    # The 304 reads the revision only: no body is assembled.
    assert "approvals_approval" not in queries[1], queries[1]


def test_a_personal_token_reads_its_groups_with_its_own_lookup(
    api: Any, operator: Any, pending_action: Any
) -> None:
    """The person's group names (who may read what) come with the token's row: the poll is
    the token lookup and the action's read, as for a run token."""
    url = f"/api/v1/actions/{pending_action.pk}"
    api.get(url, token=operator.token)
    response, queries = polled(api, url, operator.token)
    assert response.status_code == 200
    assert len(queries) == 2, queries
    assert '"auth_user_groups"' in queries[0] and "approvals_personaltoken" in queries[0]


def test_the_one_statement_body_shows_votes_execution_and_times_as_before(
    api: Any, run: Any, operator: Any, owner: Any, pending_action: Any
) -> None:
    """The facts read as SQL JSON render exactly as the model values would: names in
    vote order, Python's isoformat for timestamps (with and without microseconds)."""
    from datetime import UTC, datetime

    from approvals.models import ApprovalDecision, Decision, Operation

    approval = Approval.objects.get(action=pending_action)
    decided = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)  # no microseconds
    finished = datetime(2026, 3, 4, 5, 6, 8, 120, tzinfo=UTC)
    for person in (operator, owner):
        ApprovalDecision.objects.create(
            approval=approval, person=person.user, decision=Decision.APPROVE
        )
    Approval.objects.filter(pk=approval.pk).update(status="approved", decided_at=decided, quorum=2)
    Operation.objects.create(
        action=pending_action, fence=42, status="done", result_version=7, finished_at=finished
    )
    body = api.get(f"/api/v1/actions/{pending_action.pk}", token=run.token).json()
    assert body["approval"] == {
        "mode": "per_call",
        "decision": "approved",
        "by": f"{operator.user.username}, {owner.user.username}",
        "at": decided.isoformat(),
        "approval_id": str(approval.pk),
        "approvals_so_far": 2,
        "quorum": 2,
    }
    assert body["execution"] == {
        "fence": 42,
        "status": "done",
        "result_etag": '"7"',
        "finished_at": finished.isoformat(),
        "undo_deadline": None,
    }
    assert body["conflict"] is None
    assert body["undo"] is None


def test_the_poll_still_refuses_a_bad_token_before_looking_at_its_headers(
    api: Any, run: Any, pending_action: Any
) -> None:
    """The poll looks its token up in the same thread hop as its read; the answers
    stay those of any bearer operation: 401 for an unknown token, even with a
    malformed Prefer, and the Prefer's 400 only for a caller who is known."""
    url = f"/api/v1/actions/{pending_action.pk}"
    unknown = "rt_" + "x" * 40
    assert api.get(url, token=unknown).status_code == 401
    refused = api.get(url, token=unknown, headers={"Prefer": "wait=soon"})
    assert refused.status_code == 401
    assert refused["Content-Type"].startswith("application/problem+json")
    assert api.get(url).status_code == 401
    known = api.get(url, token=run.token, headers={"Prefer": "wait=soon"})
    assert known.status_code == 400
    assert known.json()["code"] == "bad_header"


def test_the_polls_statements_are_prepared_on_the_connection_after_a_few_polls(
    api: Any, run: Any, pending_action: Any
) -> None:
    """Server-side binding with a prepare threshold (console.settings): PostgreSQL plans
    the token lookup and the action's read once per connection, not once per poll."""
    url = f"/api/v1/actions/{pending_action.pk}"
    for _ in range(8):
        assert api.get(url, token=run.token).status_code == 200
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements WHERE NOT from_sql")
        prepared = [row[0] for row in cursor.fetchall()]
    assert any('FROM "approvals_action"' in sql and "jsonb_build_object" in sql for sql in prepared)
    assert any('"approvals_run"."token_prefix"' in sql for sql in prepared), prepared
