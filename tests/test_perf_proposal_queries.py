"""A write proposal (`PUT`/`PATCH`/`DELETE /api/v1/resources/…`, a plan, an undo) locks the audit
head only for its commit: its events are appended together by the transaction's last
statement, after the answer is rendered and stored for replay. Every writer in the system
queues for that head, so a proposal that held it from its first event to its commit
(approval insert, answer read, replay record) made every other proposal, decision and
applied write wait that long too. Statement order, not timings: the bench measures the
speed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit.chain import verify_rows
from audit.models import AuditEvent
from tests.fixtures.api import AgentActor, make_active_run
from tests.fixtures.core import applied_prod_alerts_action, make_resource
from tests.fixtures.plans import patch_step, propose_plan, three_steps

pytestmark = pytest.mark.django_db

_SAVEPOINT_END = ("RELEASE SAVEPOINT", "COMMIT")


def _head_statements(queries: list[str]) -> list[int]:
    return [n for n, sql in enumerate(queries) if "audit_audithead" in sql]


def _proposed(api: Any, agent: AgentActor, path: str, etag: str, key: str) -> tuple[Any, list]:
    run = make_active_run(agent.agent)
    with CaptureQueriesContext(connection) as captured:
        response = api.put(
            path,
            token=run.token,
            body={"severity": "critical", "ttl": 60},
            headers={"If-Match": etag, "Idempotency-Key": key},
        )
    return response, [q["sql"].strip() for q in captured.captured_queries]


def _assert_head_locked_last(queries: list[str], events: int) -> None:
    at = _head_statements(queries)
    assert len(at) == 1, "one statement appends the proposal's events:\n" + "\n".join(queries)
    after = queries[at[0] + 1 :]
    assert all(sql.startswith(_SAVEPOINT_END) for sql in after), "\n".join(after)
    appended = list(AuditEvent.objects.order_by("-seq")[:events])
    assert len(appended) == events
    assert verify_rows(AuditEvent.objects.order_by("seq")).ok


def test_a_per_call_proposal_appends_both_events_last(
    api: Any, agent: AgentActor, prod_alerts: Any
) -> None:
    response, queries = _proposed(
        api, agent, "/api/v1/resources/notification-policy/prod-alerts", '"41"', "key-head-1"
    )
    assert response.status_code == 202, response.content
    assert json.loads(response.content)["status"] == "pending_approval"
    _assert_head_locked_last(queries, events=2)
    newest = list(AuditEvent.objects.order_by("-seq").values_list("event_type", flat=True)[:2])
    assert newest == ["approval.requested", "action.proposed"]


def test_a_queued_proposal_appends_its_event_last(api: Any, agent: AgentActor) -> None:
    make_resource("dns-record/app-head", {"ttl": 30}, version=3)
    response, queries = _proposed(
        api, agent, "/api/v1/resources/dns-record/app-head", '"3"', "key-head-2"
    )
    assert response.status_code == 202, response.content
    assert json.loads(response.content)["status"] == "queued"
    _assert_head_locked_last(queries, events=1)
    # The write-set and lease check reads ownership in one statement, and runs twice:
    # before the key is claimed (the contract's order of errors), then under the locks.
    ownership = [sql for sql in queries if "ownership_ownershiprecord" in sql]
    assert len(ownership) == 2, "\n".join(ownership)


def test_a_refused_stale_proposal_appends_its_event_last(
    api: Any, agent: AgentActor, prod_alerts: Any
) -> None:
    response, queries = _proposed(
        api, agent, "/api/v1/resources/notification-policy/prod-alerts", '"40"', "key-head-3"
    )
    assert response.status_code == 412, response.content
    _assert_head_locked_last(queries, events=1)
    assert AuditEvent.objects.order_by("-seq").first().event_type == "action.refused_stale"


def _plan_proposed(api: Any, run: Any, steps: list[dict[str, Any]]) -> tuple[Any, list]:
    with CaptureQueriesContext(connection) as captured:
        response = propose_plan(api, run, steps)
    return response, [q["sql"].strip() for q in captured.captured_queries]


def test_a_plan_proposal_appends_both_events_last(api: Any, run: Any, plan_world: Any) -> None:
    response, queries = _plan_proposed(api, run, three_steps())
    assert response.status_code == 202, response.content
    assert response.json()["status"] == "pending_approval"
    _assert_head_locked_last(queries, events=2)
    newest = list(AuditEvent.objects.order_by("-seq").values_list("event_type", flat=True)[:2])
    assert newest == ["approval.requested", "plan.proposed"]


def test_a_refused_stale_plan_appends_its_event_last(api: Any, run: Any, plan_world: Any) -> None:
    response, queries = _plan_proposed(api, run, [patch_step("dns-record/app-a", '"2"', {})])
    assert response.status_code == 412, response.content
    _assert_head_locked_last(queries, events=1)
    assert AuditEvent.objects.order_by("-seq").first().event_type == "plan.refused_stale"


def test_an_undo_request_appends_its_event_last(api: Any, run: Any, prod_alerts: Any) -> None:
    action = applied_prod_alerts_action(run.run)
    with CaptureQueriesContext(connection) as captured:
        response = api.undo(action.pk, token=run.token, key="undo-head-1")
    assert response.status_code == 202, response.content
    _assert_head_locked_last([q["sql"].strip() for q in captured.captured_queries], events=1)
    assert AuditEvent.objects.order_by("-seq").first().event_type == "undo.requested"
