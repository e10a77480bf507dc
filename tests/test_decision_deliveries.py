"""A person's decision answers before its job is enqueued (issue 41): the approved action's
long-pollers are woken at commit, its job is enqueued when the answer is closed — after its
last byte under a server — not before it is written; if the answer is never closed (the
client went away) the job goes when it is collected, and a decision that raises after its
commit sends it at once.

Real commits (a transactional database) and the real Redis; the WSGI handler is called as a
server calls it, so the answer can be held open between its return and its close."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.test import RequestFactory

from approvals.api import decisions as decisions_api
from approvals.models import Approval
from approvals.notify import action_channel
from approvals.outbox import engine_queue, engine_redis, marker_key
from tests.fixtures.api import AgentActor, Person, make_active_run

pytestmark = pytest.mark.django_db(transaction=True)


def _pending_call(api: Any, agent: AgentActor) -> Approval:
    """A per-call update of prod-alerts, waiting for a person."""
    run = make_active_run(agent.agent)
    response = api.put(
        "/api/v1/resources/notification-policy/prod-alerts",
        token=run.token,
        body={"severity": "critical"},
        headers={"If-Match": '"41"', "Idempotency-Key": "key-deliveries-1"},
    )
    assert response.status_code == 202, response.content
    return Approval.objects.get(action_id=json.loads(response.content)["id"])


def _served(approval: Approval, person: Person, decision: str = "approve") -> Any:
    """The decision through Django's WSGI handler, as a server runs it: the answer is
    returned, not yet closed."""
    request = RequestFactory().post(
        f"/api/v1/approvals/{approval.pk}/decision",
        data=json.dumps({"decision": decision}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {person.token}",
    )
    statuses: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        statuses.append(status)
        return lambda data: None

    response = WSGIHandler()(request.environ, start_response)
    return response, statuses[0]


@pytest.fixture
def woken(agent: AgentActor) -> Iterator[Any]:
    """A subscriber of every action's channel: what it heard, read without waiting long."""
    client: Any = engine_redis()
    pubsub = client.pubsub()
    pubsub.psubscribe(action_channel("*"))
    assert pubsub.get_message(timeout=2)["type"] == "psubscribe"

    def heard(action_id: Any, timeout: float = 0.3) -> bool:
        while (message := pubsub.get_message(timeout=timeout)) is not None:
            if message["channel"] == action_channel(action_id).encode():
                return True
        return False

    yield heard
    pubsub.close()


def _queued(action_id: Any) -> bool:
    client: Any = engine_redis()
    job_id = client.get(marker_key("action", action_id))
    return job_id is not None and job_id.decode() in engine_queue().get_job_ids()


def test_the_approved_calls_job_is_enqueued_when_its_answer_is_closed(
    api: Any, agent: AgentActor, operator: Person, prod_alerts: Any, woken: Any
) -> None:
    approval = _pending_call(api, agent)
    response, status = _served(approval, operator)
    assert status.startswith("200"), b"".join(response)
    assert json.loads(b"".join(response))["status"] == "approved"
    # Committed and answered: the waiting agent is woken, the job not queued yet.
    assert woken(approval.action_id)
    assert not _queued(approval.action_id)
    response.close()
    assert _queued(approval.action_id)


def test_an_answer_never_closed_enqueues_the_job_when_it_is_collected(
    api: Any, agent: AgentActor, operator: Person, prod_alerts: Any
) -> None:
    approval = _pending_call(api, agent)
    response, status = _served(approval, operator)
    assert status.startswith("200")
    assert not _queued(approval.action_id)
    del response
    gc.collect()
    assert _queued(approval.action_id)


def test_a_decision_whose_answer_fails_after_its_commit_enqueues_the_job_at_once(
    api: Any, agent: AgentActor, operator: Person, prod_alerts: Any, monkeypatch: Any
) -> None:
    approval = _pending_call(api, agent)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("rendering failed")

    monkeypatch.setattr(decisions_api, "approval_json", broken)
    response, status = _served(approval, operator)
    assert status.startswith("500")
    assert Approval.objects.get(pk=approval.pk).status == "approved"  # committed
    assert _queued(approval.action_id)  # before the answer is closed
    response.close()
