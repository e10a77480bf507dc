"""REST endpoints for auto-approve rules: admins write through the audited services
(approvals/services/rules.py); operators, admins and auditors read."""

from __future__ import annotations

import json
from typing import Any

import pytest

from approvals.models import AutoApproveRule
from audit.models import AuditEvent

pytestmark = pytest.mark.django_db

RULES = "/api/v1/auto-approve-rules"
SANDBOX = {
    "kind": "dns-record",
    "name_prefix": "sandbox-",
    "operations": ["update", "create"],
    "description": "sandbox names",
}


def body(response: Any, status: int) -> Any:
    assert response.status_code == status, response.content
    return json.loads(response.content) if response.content else None


def test_an_admin_creates_replaces_and_deletes_a_rule_each_audited_once(
    api: Any, admin: Any, agent: Any
) -> None:
    created = api.post(RULES, token=admin.token, body=SANDBOX)
    rule = body(created, 201)
    assert created["Location"] == f"{RULES}/{rule['id']}"
    assert rule == {
        "id": rule["id"],
        "kind": "dns-record",
        "name_prefix": "sandbox-",
        "operations": ["create", "update"],  # canonical order
        "agent": None,
        "enabled": True,
        "description": "sandbox names",
    }
    assert body(api.get(f"{RULES}/{rule['id']}", token=admin.token), 200) == rule
    assert AuditEvent.objects.filter(event_type="auto_approve_rule.created").count() == 1

    replaced = dict(SANDBOX, agent="deploy-bot", enabled=False)
    shown = body(api.put(f"{RULES}/{rule['id']}", token=admin.token, body=replaced), 200)
    assert shown["agent"] == "deploy-bot" and shown["enabled"] is False
    # The same replacement again changes nothing: no second audit row.
    body(api.put(f"{RULES}/{rule['id']}", token=admin.token, body=replaced), 200)
    assert AuditEvent.objects.filter(event_type="auto_approve_rule.updated").count() == 1

    assert api.delete(f"{RULES}/{rule['id']}", token=admin.token).status_code == 204
    assert not AutoApproveRule.objects.filter(pk=rule["id"]).exists()
    body(api.delete(f"{RULES}/{rule['id']}", token=admin.token), 404)
    body(api.put(f"{RULES}/{rule['id']}", token=admin.token, body=SANDBOX), 404)
    assert AuditEvent.objects.filter(event_type="auto_approve_rule.deleted").count() == 1


def test_a_rule_created_over_the_api_auto_approves_a_covered_run(
    api: Any, admin: Any, agent: Any
) -> None:
    run = {
        "task": "sandbox",
        "write_set": [{"resource": "dns-record/sandbox-1", "operations": ["create"]}],
    }
    first = body(api.post("/api/v1/runs", token=agent.token, body=run), 201)
    assert first["status"] == "pending_approval"
    body(api.post(RULES, token=admin.token, body=SANDBOX), 201)
    second = body(
        api.post(
            "/api/v1/runs",
            token=agent.token,
            body={
                **run,
                "write_set": [{"resource": "dns-record/sandbox-2", "operations": ["create"]}],
            },
        ),
        201,
    )
    assert second["status"] == "active" and second["auto_approved"] is True


def test_only_admins_write_and_only_readers_read(
    api: Any, admin: Any, operator: Any, auditor: Any, outsider: Any, agent: Any, run: Any
) -> None:
    rule = body(api.post(RULES, token=admin.token, body=SANDBOX), 201)
    for reader in (admin, operator, auditor):
        page = body(api.get(RULES, token=reader.token), 200)
        assert [item["id"] for item in page["items"]] == [rule["id"]] and page["next"] is None
    body(api.get(RULES, token=outsider.token), 403)
    body(api.get(f"{RULES}/{rule['id']}", token=outsider.token), 403)
    body(api.get(RULES, token=agent.token), 403)  # a personal token is needed
    body(api.get(RULES, token=run.token), 403)
    body(api.get(RULES), 401)
    before = AuditEvent.objects.count()
    for writer in (operator, auditor, outsider):
        body(api.post(RULES, token=writer.token, body=SANDBOX), 403)
        body(api.put(f"{RULES}/{rule['id']}", token=writer.token, body=SANDBOX), 403)
        body(api.delete(f"{RULES}/{rule['id']}", token=writer.token), 403)
    assert AuditEvent.objects.count() == before
    assert AutoApproveRule.objects.count() == 1


def test_invalid_rules_are_422_and_write_nothing(api: Any, admin: Any) -> None:
    before = AuditEvent.objects.count()
    unknown_kind = body(api.post(RULES, token=admin.token, body=dict(SANDBOX, kind="nope")), 422)
    assert unknown_kind["code"] == "validation_error"
    assert {e["field"] for e in unknown_kind["errors"]} == {"kind"}
    body(api.post(RULES, token=admin.token, body=dict(SANDBOX, agent="ghost")), 422)
    body(api.post(RULES, token=admin.token, body=dict(SANDBOX, operations=[])), 422)
    body(api.post(RULES, token=admin.token, body=dict(SANDBOX, operations=["drop"])), 422)
    body(api.post(RULES, token=admin.token, body=dict(SANDBOX, surprise=1)), 422)
    body(api.post(RULES, token=admin.token, raw="{not json"), 400)
    body(api.get(f"{RULES}/0", token=admin.token), 422)
    body(api.get(f"{RULES}/99999999999999999999", token=admin.token), 422)
    assert AuditEvent.objects.count() == before
    assert not AutoApproveRule.objects.exists()


def test_the_rule_list_pages_by_id(api: Any, admin: Any, agent: Any) -> None:
    ids = []
    for n in range(5):
        created = api.post(RULES, token=admin.token, body=dict(SANDBOX, name_prefix=f"p{n}-"))
        ids.append(body(created, 201)["id"])
    seen: list[int] = []
    cursor = None
    while True:
        path = f"{RULES}?limit=2" + (f"&cursor={cursor}" if cursor else "")
        page = body(api.get(path, token=admin.token), 200)
        seen += [item["id"] for item in page["items"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == ids
