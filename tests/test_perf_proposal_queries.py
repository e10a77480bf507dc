"""A write proposal (`PUT`/`PATCH`/`DELETE /api/v1/resources/…`, a plan, an undo) appends its
events together, in one statement, as the transaction's last, after the answer is rendered and
stored for replay. (That once kept the audit head's lock short; appends take no lock now —
audit/linker.py links them after the commit — and one statement a proposal is what is left of
the rule.) Statement order, not timings: the bench measures the speed."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connection
from django.db.models import Max
from django.test.utils import CaptureQueriesContext

from audit.linker import audit_link
from audit.models import AuditEvent
from audit.verify import verify_chain
from tests.fixtures.api import AgentActor, make_active_run
from tests.fixtures.core import applied_prod_alerts_action, make_resource
from tests.fixtures.plans import patch_step, propose_plan, three_steps

pytestmark = pytest.mark.django_db

_SAVEPOINT_END = ("RELEASE SAVEPOINT", "COMMIT")
PROD_ALERTS = "/api/v1/resources/notification-policy/prod-alerts"


@dataclass(frozen=True)
class Captured:
    response: Any
    queries: list[str]
    events: list[str]  # the types of the events the call appended, in chain order


def _captured(call: Callable[[], Any]) -> Captured:
    before = AuditEvent.objects.aggregate(seq=Max("seq"))["seq"] or 0
    with CaptureQueriesContext(connection) as captured:
        response = call()
    appended = AuditEvent.objects.filter(seq__gt=before).order_by("seq")
    return Captured(
        response,
        [q["sql"].strip() for q in captured.captured_queries],
        list(appended.values_list("event_type", flat=True)),
    )


def _put(api: Any, agent: AgentActor, path: str, etag: str, key: str) -> Captured:
    run = make_active_run(agent.agent)
    return _captured(
        lambda: api.put(
            path,
            token=run.token,
            body={"severity": "critical", "ttl": 60},
            headers={"If-Match": etag, "Idempotency-Key": key},
        )
    )


def _assert_appended_last(captured: Captured, events: list[str]) -> None:
    """Exactly `events` appended, by one statement that only the savepoint's end follows."""
    queries = captured.queries
    at = [n for n, sql in enumerate(queries) if "INSERT INTO audit_auditevent" in sql]
    assert len(at) == 1, "one statement appends the call's events:\n" + "\n".join(queries)
    after = queries[at[0] + 1 :]
    assert all(sql.startswith(_SAVEPOINT_END) for sql in after), "\n".join(after)
    assert captured.events == events
    audit_link()
    assert verify_chain().ok


def test_a_per_call_proposal_appends_both_events_last(
    api: Any, agent: AgentActor, prod_alerts: Any
) -> None:
    captured = _put(api, agent, PROD_ALERTS, '"41"', "key-head-1")
    assert captured.response.status_code == 202, captured.response.content
    assert json.loads(captured.response.content)["status"] == "pending_approval"
    _assert_appended_last(captured, ["action.proposed", "approval.requested"])


def test_a_queued_proposal_appends_its_event_last(api: Any, agent: AgentActor) -> None:
    make_resource("dns-record/app-head", {"ttl": 30}, version=3)
    captured = _put(api, agent, "/api/v1/resources/dns-record/app-head", '"3"', "key-head-2")
    assert captured.response.status_code == 202, captured.response.content
    assert json.loads(captured.response.content)["status"] == "queued"
    _assert_appended_last(captured, ["action.proposed"])
    # The write-set and lease check reads ownership in one statement, and runs twice:
    # before the key is claimed (the contract's order of errors), then under the locks.
    ownership = [sql for sql in captured.queries if "ownership_ownershiprecord" in sql]
    assert len(ownership) == 2, "\n".join(ownership)


def test_a_refused_stale_proposal_appends_its_event_last(
    api: Any, agent: AgentActor, prod_alerts: Any
) -> None:
    captured = _put(api, agent, PROD_ALERTS, '"40"', "key-head-3")
    assert captured.response.status_code == 412, captured.response.content
    _assert_appended_last(captured, ["action.refused_stale"])


def test_a_plan_proposal_appends_both_events_last(api: Any, run: Any, plan_world: Any) -> None:
    captured = _captured(lambda: propose_plan(api, run, three_steps()))
    assert captured.response.status_code == 202, captured.response.content
    assert captured.response.json()["status"] == "pending_approval"
    _assert_appended_last(captured, ["plan.proposed", "approval.requested"])


def test_a_refused_stale_plan_appends_its_event_last(api: Any, run: Any, plan_world: Any) -> None:
    stale = [patch_step("dns-record/app-a", '"2"', {})]
    captured = _captured(lambda: propose_plan(api, run, stale))
    assert captured.response.status_code == 412, captured.response.content
    _assert_appended_last(captured, ["plan.refused_stale"])


def test_an_undo_request_appends_its_event_last(api: Any, run: Any, prod_alerts: Any) -> None:
    action = applied_prod_alerts_action(run.run)
    captured = _captured(lambda: api.undo(action.pk, token=run.token, key="undo-head-1"))
    assert captured.response.status_code == 202, captured.response.content
    _assert_appended_last(captured, ["undo.requested"])
