"""A person's decision (`POST /api/v1/approvals/{id}/decision`) is most of the approval
round trip (issue 11): its statements are counted here, with an upper bound, so a
regression fails; and its answer, rendered from the rows the decision locked, must be
exactly what reading the approval afresh shows. Counts, not timings: the bench measures
the speed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from approvals.api.serialize import approval_json
from approvals.models import Approval
from approvals.notify import action_channel
from approvals.outbox import engine_queue, engine_redis, marker_key
from approvals.services.decisions import approval_decide_tallied
from audit.linker import audit_link
from audit.services import Actor
from ownership.models import ConflictClass
from tests.fixtures.api import (
    AgentActor,
    Person,
    ensure_api_kinds,
    make_active_run,
    make_person_with_token,
)

pytestmark = pytest.mark.django_db

# Token lookup (with the decider's groups); one statement that peeks at the approval's
# subject, locks run (share), action and approval and reads the agent's live tokens
# (separation of duties) and the resource the answer's diff is taken against; the votes so
# far with the vote and what it does (the approval's and the action's status) in one — one
# statement fewer than when the settle was its own (7); the two audit events
# chained by one last statement (the head locked for the commit only) — and the test
# transaction's savepoint pair.
PER_CALL_DECISION_STATEMENTS = 6


def _propose_prod_alerts(api: Any, agent: AgentActor, key: str = "key-decision-1") -> Approval:
    """A per-call update of prod-alerts (replace_shared_document), waiting for a person."""
    run = make_active_run(agent.agent)
    response = api.put(
        "/api/v1/resources/notification-policy/prod-alerts",
        token=run.token,
        body={"severity": "critical"},
        headers={"If-Match": '"41"', "Idempotency-Key": key},
    )
    assert response.status_code == 202, response.content
    return Approval.objects.get(action_id=json.loads(response.content)["id"])


def _decided(api: Any, person: Person, approval: Approval, decision: str) -> dict[str, Any]:
    response = api.decide(approval.pk, decision, token=person.token, comment="looked at it")
    assert response.status_code == 200, response.content
    return dict(json.loads(response.content))


def _fresh(api: Any, person: Person, approval: Approval) -> dict[str, Any]:
    response = api.get(f"/api/v1/approvals/{approval.pk}", token=person.token)
    assert response.status_code == 200, response.content
    return dict(json.loads(response.content))


@pytest.fixture
def second_operator(db: Any) -> Person:
    return make_person_with_token("bea", "operators")


def test_a_per_call_decision_costs_a_bounded_number_of_statements(
    api: Any, agent: AgentActor, operator: Person, prod_alerts: Any
) -> None:
    approval = _propose_prod_alerts(api, agent)
    api.get("/api/v1/approvals", token=operator.token)  # the token's last_used write first
    with CaptureQueriesContext(connection) as captured:
        response = api.decide(approval.pk, "approve", token=operator.token)
    assert response.status_code == 200, response.content
    assert json.loads(response.content)["status"] == "approved"
    queries = [q["sql"] for q in captured.captured_queries]
    assert len(queries) <= PER_CALL_DECISION_STATEMENTS, "\n".join(queries)
    # The approval is read by one statement (its subject peeked, then locked) and nothing
    # is read after the transaction: the answer is rendered from what it read.
    approval_reads = [
        q
        for q in queries
        if not q.lstrip().startswith("UPDATE") and 'FROM "approvals_approval"' in q
    ]
    assert len(approval_reads) == 1, approval_reads
    assert queries[-1].startswith(("RELEASE SAVEPOINT", "COMMIT")), queries[-1]
    # The audit events are appended by the transaction's last statement, in one (an INSERT
    # that takes no lock: audit/linker.py links them after the commit).
    assert "INSERT INTO audit_auditevent" in queries[-2] and all(
        "audit_auditevent" not in query for query in queries[:-2]
    ), queries


@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_a_call_decisions_answer_is_what_a_fresh_read_shows(
    api: Any, agent: AgentActor, operator: Person, prod_alerts: Any, decision: str
) -> None:
    approval = _propose_prod_alerts(api, agent)
    answer = _decided(api, operator, approval, decision)
    assert answer["status"] == ("approved" if decision == "approve" else "rejected")
    assert answer == _fresh(api, operator, approval)


def test_a_vote_below_quorum_answers_what_a_fresh_read_shows(
    api: Any, agent: AgentActor, operator: Person, second_operator: Person, prod_alerts: Any
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    approval = _propose_prod_alerts(api, agent)
    first = _decided(api, operator, approval, "approve")
    assert (first["status"], first["approvals_so_far"]) == ("pending", 1)
    assert first == _fresh(api, operator, approval)
    second = _decided(api, second_operator, approval, "approve")
    assert (second["status"], second["approvals_so_far"]) == ("approved", 2)
    assert second == _fresh(api, operator, approval)


@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_a_run_decisions_answer_is_what_a_fresh_read_shows(
    api: Any, agent: AgentActor, operator: Person, decision: str
) -> None:
    ensure_api_kinds()
    created = api.create_run(
        agent.token, [{"resource": "dns-record/app-web", "operations": ["update"]}]
    )
    assert created.status_code == 201, created.content
    approval = Approval.objects.get(run_id=json.loads(created.content)["id"], subject="run")
    answer = _decided(api, operator, approval, decision)
    assert answer["subject"] == "run"
    assert answer == _fresh(api, operator, approval)


@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_the_orm_path_of_the_embedded_default_decides_a_call_the_same_way(
    api: Any, agent: AgentActor, operator: Person, prod_alerts: Any, decision: str, monkeypatch: Any
) -> None:
    # SQLite (the embedded default) takes the ORM statements instead of decision_rows'; on
    # PostgreSQL they must leave the same rows and the same answer.
    approval = _propose_prod_alerts(api, agent)
    # The SQLite path chains its events at once after the head: link what PostgreSQL's
    # appends left unlinked first, so that the head is the newest event.
    audit_link()
    monkeypatch.setattr(connection, "vendor", "sqlite")
    decided = approval_decide_tallied(
        approval_id=approval.pk, actor=Actor.person(operator.user), decision=decision
    )
    monkeypatch.undo()
    assert not decided.resource_read
    rendered = approval_json(decided.approval, approvals_so_far=decided.approvals_so_far)
    answer = json.loads(json.dumps(rendered))
    assert answer == _fresh(api, operator, approval)
    approval.refresh_from_db()
    assert approval.action is not None
    expected = "queued" if decision == "approve" else "rejected"
    assert (approval.status, approval.action.status) == (answer["status"], expected)
    assert approval.decisions.count() == 1


def test_an_approved_calls_wake_up_and_job_go_in_one_redis_round_trip(
    api: Any,
    agent: AgentActor,
    operator: Person,
    prod_alerts: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    # After commit the decision hands Redis the action's job, its outbox marker and the
    # long-pollers' wake-up: one after-commit callback, one pipeline (a publish of its own
    # was a second callback and a second round trip). The wake-up still reaches a
    # subscriber of the action's channel, and the job is queued.
    approval = _propose_prod_alerts(api, agent)
    assert approval.action_id is not None
    client: Any = engine_redis()
    pubsub = client.pubsub()
    pubsub.subscribe(action_channel(approval.action_id))
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    try:
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            answer = _decided(api, operator, approval, "approve")
        assert answer["status"] == "approved"
        assert len(callbacks) == 1, callbacks
        woken = pubsub.get_message(timeout=2)
        assert woken is not None and woken["data"] == b"changed", woken
    finally:
        pubsub.close()
    job_id = client.get(marker_key("action", approval.action_id))
    assert job_id is not None and job_id.decode() in engine_queue().get_job_ids()
