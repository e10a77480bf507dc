"""End to end through the REST API with a real worker: propose -> approve -> applied,
reject -> the agent reads the comment, expiry, conflict resolution and undo."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action
from approvals.services.housekeeping import housekeeping_run
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

POLICY = "/api/v1/resources/notification-policy/prod-alerts"


def _propose(api: Any, run: Any, patch: dict[str, Any], key: str, etag: str = '"41"') -> Any:
    response = api.patch(
        POLICY, token=run.token, body=patch, headers={"If-Match": etag, "Idempotency-Key": key}
    )
    assert response.status_code == 202, response.content
    return response.json()


def _action(api: Any, token: str, action_id: str) -> dict[str, Any]:
    response = api.get(f"/api/v1/actions/{action_id}", token=token)
    assert response.status_code == 200, response.content
    return response.json()


def _pending_item(api: Any, person: Any, action_id: str) -> dict[str, Any]:
    listing = api.get("/api/v1/approvals?status=pending", token=person.token)
    assert listing.status_code == 200, listing.content
    [item] = [i for i in listing.json()["items"] if i.get("action") == action_id]
    return item


def _decide(api: Any, person: Any, item: dict[str, Any], **decision: str) -> Any:
    """POST `decision` ({"decision": ..., "comment": ...}) on the approval `item`."""
    return api.post(f"/api/v1/approvals/{item['id']}/decision", token=person.token, body=decision)


def test_propose_approve_apply_through_the_api(
    api: Any, run: Any, operator: Any, prod_alerts: Any, rq_worker: Any
) -> None:
    worker = rq_worker()
    assert api.get(POLICY, token=run.token)["ETag"] == '"41"'
    action = _propose(api, run, {"channels": ["email", "pager"]}, "key-approve-0001")
    assert action["status"] == "pending_approval"

    item = _pending_item(api, operator, action["id"])
    decided = _decide(api, operator, item, decision="approve", comment="looks right")
    assert decided.status_code == 200, decided.content
    again = _decide(api, operator, item, decision="approve")
    assert again.status_code == 409 and again["Content-Type"] == "application/problem+json"

    wait_for(lambda: _action(api, run.token, action["id"])["status"] == "applied", timeout=20)
    body = _action(api, run.token, action["id"])
    assert body["execution"]["result_etag"] == '"42"', worker.output()
    assert api.get(POLICY, token=run.token).json()["document"]["channels"] == ["email", "pager"]


@pytest.mark.django_db
def test_a_rejection_comment_reaches_the_agent_and_expiry_expires(
    api: Any, run: Any, operator: Any, prod_alerts: Any, engine_redis: Any
) -> None:
    rejected = _propose(api, run, {"severity": "info"}, "key-reject-00001")
    item = _pending_item(api, operator, rejected["id"])
    response = _decide(api, operator, item, decision="reject", comment="info would hide pages")
    assert response.status_code == 200, response.content
    body = _action(api, run.token, rejected["id"])
    assert body["status"] == "rejected"
    assert body["error"]["comment"] == "info would hide pages"

    expiring = _propose(api, run, {"severity": "error"}, "key-expire-00001")
    housekeeping_run(now=timezone.now() + timedelta(hours=49))
    assert _action(api, run.token, expiring["id"])["status"] == "expired"


@pytest.mark.django_db
def test_a_person_cannot_decide_without_the_role_and_the_agent_cannot_at_all(
    api: Any, run: Any, operator: Any, outsider: Any, prod_alerts: Any, engine_redis: Any
) -> None:
    action = _propose(api, run, {"severity": "error"}, "key-forbid-00001")
    item = _pending_item(api, operator, action["id"])
    path = f"/api/v1/approvals/{item['id']}/decision"
    assert api.post(path, token=outsider.token, body={"decision": "approve"}).status_code in (
        403,
        404,
    )
    assert api.post(path, token=run.token, body={"decision": "approve"}).status_code in (401, 403)
    assert Action.objects.get(pk=action["id"]).status == "pending_approval"


def test_a_collision_is_resolved_by_merge_and_a_later_undo_becomes_a_conflict(
    api: Any, run: Any, operator: Any, owner: Any, prod_alerts: Any, rq_worker: Any
) -> None:
    from tests.fixtures.api import make_person_with_token

    second_operator = make_person_with_token("bruno", "operators")
    worker = rq_worker()
    # The same run sends two full-document writes, both read at version 41.
    first = _propose(api, run, {"severity": "critical"}, "key-collide-0001")
    second = _propose(
        api, run, {"channels": ["email", "pager"], "severity": "warning"}, "key-collide-0002"
    )
    for action in (first, second):
        item = _pending_item(api, operator, action["id"])
        response = _decide(api, operator, item, decision="approve")
        assert response.status_code == 200, response.content
    wait_for(
        lambda: (
            _action(api, run.token, second["id"])["status"] in {"applied", "conflict"}
            and _action(api, run.token, first["id"])["status"] in {"applied", "conflict"}
        ),
        timeout=20,
    )
    statuses = {a["id"]: _action(api, run.token, a["id"])["status"] for a in (first, second)}
    assert sorted(statuses.values()) == ["applied", "conflict"], worker.output()
    loser = next(i for i, s in statuses.items() if s == "conflict")
    body = _action(api, run.token, loser)
    conflict_id = body["conflict"]["conflict_id"]
    assert body["conflict"]["retryable_by_agent"] is False

    listing = api.get("/api/v1/conflicts?status=open&mine=true", token=second_operator.token)
    assert [c["id"] for c in listing.json()["items"]] == [conflict_id]
    conflict = api.get(f"/api/v1/conflicts/{conflict_id}", token=second_operator.token).json()
    fields = {f["path"]: "proposed" for f in conflict["fields"] if f["change"] != "other_only"}
    forbidden = api.post(
        f"/api/v1/conflicts/{conflict_id}/resolution",
        token=owner.token,
        body={"choice": "merge", "fields": fields},
    )
    assert forbidden.status_code in (403, 404)
    resolved = api.post(
        f"/api/v1/conflicts/{conflict_id}/resolution",
        token=second_operator.token,
        body={"choice": "merge", "fields": fields, "comment": "both"},
    )
    assert resolved.status_code == 200, resolved.content
    new_id = _action(api, run.token, loser)["resolution_action"]
    assert new_id
    wait_for(lambda: _action(api, run.token, new_id)["status"] == "applied", timeout=20)
    assert api.get(POLICY, token=run.token)["ETag"] == '"43"'

    # Undo of the first applied write now finds a later version: a conflict for a person.
    winner = next(i for i, s in statuses.items() if s == "applied")
    undo = api.undo(winner, token=run.token, key="key-undo-000001")
    assert undo.status_code == 202, undo.content
    wait_for(
        lambda: (_action(api, run.token, winner).get("undo") or {}).get("conflict_id") is not None,
        timeout=20,
    )
    assert _action(api, run.token, winner)["status"] == "applied"
    assert api.get(POLICY, token=run.token)["ETag"] == '"43"'
