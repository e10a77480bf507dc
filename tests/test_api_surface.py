"""The rest of the surface: tokens and commands, resource reads, actions and their
approvals, conflicts, catalog, audit, kill switch, docs, healthz and metrics."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.core.management import call_command

from approvals.models import Action, AgentToken, PersonalToken
from audit.models import AuditEvent
from ownership.models import Resource, ResourceVersion
from tests.fixtures.api import make_agent_with_token
from tests.fixtures.core import (
    applied_prod_alerts_action,
    make_action,
    make_resource,
    prod_alerts_action,
)

pytestmark = pytest.mark.django_db

PROD = "/api/v1/resources/notification-policy/prod-alerts"


def body(response: Any) -> Any:
    return json.loads(response.content)


def propose(api: Any, run: Any, key: str = "key-surface-01", **headers: str) -> Any:
    return api.patch(
        PROD,
        token=run.token,
        body={"channels": ["email", "pager"]},
        headers={"If-Match": '"41"', "Idempotency-Key": key, **headers},
    )


# --- tokens and commands -------------------------------------------------------


def test_agent_create_prints_a_working_token_last_and_stores_only_its_hash(api: Any) -> None:
    out = io.StringIO()
    call_command("agent_create", "deploy-bot", stdout=out)
    token = out.getvalue().strip().splitlines()[-1]
    assert token.startswith("ak_")
    stored = AgentToken.objects.get(agent__name="deploy-bot")
    assert stored.token_hash != token and token not in stored.token_hash
    assert token.startswith(stored.prefix)
    me = body(api.get("/api/v1/whoami", token=token))
    assert me == {"principal": "agent", "name": "deploy-bot"}


def test_person_create_with_role_groups_and_password(api: Any) -> None:
    out = io.StringIO()
    call_command(
        "person_create",
        "ana",
        "--role",
        "operator",
        "--group",
        "platform",
        "--password",
        "s3cret-passphrase",
        stdout=out,
    )
    token = out.getvalue().strip().splitlines()[-1]
    assert token.startswith("pt_")
    user = PersonalToken.objects.get().user
    assert set(user.groups.values_list("name", flat=True)) == {"operators", "platform"}
    assert user.check_password("s3cret-passphrase")
    assert api.get("/api/v1/approvals", token=token).status_code == 200
    assert not AuditEvent.objects.filter(details__icontains=token[4:]).exists()


# --- resources ----------------------------------------------------------------


def test_a_resource_has_a_strong_etag_and_answers_304(
    api: Any, agent: Any, prod_alerts: Any
) -> None:
    response = api.get(PROD, token=agent.token)
    assert response.status_code == 200
    assert response["ETag"] == '"41"'
    data = body(response)
    assert data["version"] == 41 and data["etag"] == '"41"' and data["owner_group"] == "platform"
    for held in ('"41"', 'W/"41"', '"40", "41"', "*"):
        not_modified = api.get(PROD, token=agent.token, headers={"If-None-Match": held})
        assert not_modified.status_code == 304, held
        assert not_modified["ETag"] == '"41"'
    assert api.get(PROD, token=agent.token, headers={"If-None-Match": '"40"'}).status_code == 200


def test_a_deleted_resource_is_404(api: Any, agent: Any, prod_alerts: Any) -> None:
    Resource.objects.filter(pk=prod_alerts.pk).update(deleted=True, version=42)
    assert api.get(PROD, token=agent.token).status_code == 404


def test_resources_are_listed_by_kind_and_prefix_with_pagination(api: Any, agent: Any) -> None:
    for n in range(5):
        make_resource(f"dns-record/app-{n}", {"n": n})
    make_resource("dns-record/db-1", {"n": 9})
    make_resource("notification-policy/app-x", {})
    names: list[str] = []
    url = "/api/v1/resources?kind=dns-record&prefix=app-&limit=2"
    while url:
        page = body(api.get(url, token=agent.token))
        names += [item["name"] for item in page["items"]]
        url = (
            f"/api/v1/resources?kind=dns-record&prefix=app-&limit=2&cursor={page['next']}"
            if page["next"]
            else ""
        )
    assert names == [f"app-{n}" for n in range(5)]
    too_many = api.get("/api/v1/resources?limit=201", token=agent.token)
    assert too_many.status_code == 422


def test_a_create_with_if_none_match_star(api: Any, run: Any) -> None:
    # Also the check that issue 9's strict If-Match parsing left If-None-Match: * alone.
    info = {"severity": "info"}
    action = api.accepted_write(
        run.token, "put", "notification-policy/staging-new", info, if_none_match="*"
    )
    assert action["operation"] == "create" and action["observed_etag"] is None
    make_resource("notification-policy/staging-taken", {"a": 1}, version=3)
    taken = api.write(
        run.token, "put", "notification-policy/staging-taken", info, if_none_match="*"
    )
    assert taken.status_code == 412
    assert body(taken)["current_etag"] == '"3"'


def test_a_write_echoes_and_records_the_request_id(api: Any, run: Any, prod_alerts: Any) -> None:
    response = propose(api, run, **{"X-Request-Id": "req-abc.123"})
    assert response["X-Request-Id"] == "req-abc.123"
    event = AuditEvent.objects.get(event_type="action.proposed")
    assert event.request_id == "req-abc.123"
    assert Action.objects.get().request_id == "req-abc.123"
    generated = api.get(PROD, token=run.token)["X-Request-Id"]
    assert len(generated) >= 16


def test_airlock_reason_is_kept_and_limited(api: Any, run: Any, prod_alerts: Any) -> None:
    response = propose(api, run, **{"Airlock-Reason": "add pager as backup"})
    assert body(response)["reason"] == "add pager as backup"
    assert AuditEvent.objects.get(event_type="action.proposed").details["reason"] == (
        "add pager as backup"
    )
    too_long = propose(api, run, key="key-surface-02", **{"Airlock-Reason": "x" * 501})
    assert too_long.status_code == 400


# --- actions, approvals -----------------------------------------------------------


def test_a_per_call_write_waits_for_an_operator_and_is_queued_on_approval(
    api: Any, run: Any, prod_alerts: Any, operator: Any
) -> None:
    action = body(propose(api, run))
    assert action["status"] == "pending_approval"
    pending = body(api.get("/api/v1/approvals?status=pending", token=operator.token))["items"]
    (call,) = [item for item in pending if item["subject"] == "action"]
    assert call["action"] == action["id"]
    assert call["diff"] == [
        {"path": "/channels", "current": ["email"], "proposed": ["email", "pager"]}
    ]
    assert call["observed_etag"] == call["current_etag"] == '"41"'
    decided = api.decide(call["id"], "approve", token=operator.token, comment="ok")
    assert decided.status_code == 200, decided.content
    assert body(decided)["status"] == "approved"
    after = body(api.get(f"/api/v1/actions/{action['id']}", token=run.token))
    assert after["status"] in ("queued", "executing", "applied")
    assert after["approval"]["decision"] == "approved" and after["approval"]["by"] == "ana"
    again = api.decide(call["id"], "approve", token=operator.token)
    assert again.status_code == 409


def test_the_agents_owner_may_not_approve_its_call(
    api: Any, agent: Any, run: Any, prod_alerts: Any, operator: Any
) -> None:
    agent.agent.owner = operator.user
    agent.agent.save()
    action = body(propose(api, run))
    approval_id = action["approval"]["approval_id"]
    response = api.decide(approval_id, "approve", token=operator.token)
    assert response.status_code == 403
    assert body(response)["code"] in ("self_approval", "forbidden")


def test_an_action_has_an_etag_and_answers_304(api: Any, run: Any, prod_alerts: Any) -> None:
    response = propose(api, run)
    url = response["Location"]
    first = api.get(url, token=run.token)
    assert first["ETag"] == body(first)["etag"] == '"a1"'
    assert api.get(url, token=run.token, headers={"If-None-Match": '"a1"'}).status_code == 304
    # a short long-poll through the in-process client: unchanged -> 304 after the wait
    held = api.get(url, token=run.token, headers={"If-None-Match": '"a1"', "Prefer": "wait=1"})
    assert held.status_code == 304 and held["Preference-Applied"] == "wait=1"


def test_cancel_before_execution_only(api: Any, run: Any, prod_alerts: Any) -> None:
    action = body(propose(api, run))
    cancelled = api.post(f"/api/v1/actions/{action['id']}/cancel", token=run.token)
    assert cancelled.status_code == 200 and body(cancelled)["status"] == "cancelled"
    events = AuditEvent.objects.filter(event_type="action.cancelled").count()
    assert api.post(f"/api/v1/actions/{action['id']}/cancel", token=run.token).status_code == 200
    assert AuditEvent.objects.filter(event_type="action.cancelled").count() == events == 1
    applied = make_action(
        run=run.run, identifier="notification-policy/prod-alerts", observed_version=41
    )
    Action.objects.filter(pk=applied.pk).update(status="applied")
    late = api.post(f"/api/v1/actions/{applied.pk}/cancel", token=run.token)
    assert late.status_code == 409


def test_a_person_cancels_only_with_the_operator_role(
    api: Any, run: Any, owner: Any, operator: Any, prod_alerts: Any
) -> None:
    url = f"/api/v1/actions/{body(propose(api, run))['id']}/cancel"
    refused = api.post(url, token=owner.token)  # the owner reads the action, may not cancel it
    assert refused.status_code == 403 and body(refused)["code"] == "forbidden"
    assert not AuditEvent.objects.filter(event_type="action.cancelled").exists()
    cancelled = api.post(url, token=operator.token)
    assert cancelled.status_code == 200 and body(cancelled)["status"] == "cancelled"


def test_undo_of_an_applied_action_is_accepted_once(api: Any, run: Any, prod_alerts: Any) -> None:
    from approvals.models import Operation

    action = applied_prod_alerts_action(run.run)
    shown = body(api.get(f"/api/v1/actions/{action.pk}", token=run.token))
    assert shown["status"] == "applied"
    assert shown["execution"]["result_etag"] == '"42"'
    assert shown["execution"]["undo_deadline"]
    first = api.undo(action.pk, token=run.token, key="undo-0001")
    assert first.status_code == 202, first.content
    second = api.undo(action.pk, token=run.token, key="undo-0002")
    assert second.status_code == 202
    assert Operation.objects.filter(action=action, undo_of__isnull=False).count() == 1


# --- conflicts ---------------------------------------------------------------------


def test_a_conflict_is_shown_to_its_resolver_and_resolved(
    api: Any, run: Any, prod_alerts: Any, operator: Any, outsider: Any
) -> None:
    from ownership.services.conflicts import conflict_open_for_action

    action = prod_alerts_action(run.run)
    Resource.objects.filter(pk=prod_alerts.pk).update(
        version=42, document={"severity": "warning", "channels": ["sms"]}
    )
    ResourceVersion.objects.create(
        resource=prod_alerts,
        version=42,
        document={"severity": "warning", "channels": ["sms"]},
        operation="update",
    )
    conflict = conflict_open_for_action(action_id=action.pk)
    assert conflict is not None
    mine = body(api.get("/api/v1/conflicts?status=open&mine=true", token=operator.token))
    assert [item["id"] for item in mine["items"]] == [str(conflict.pk)]
    assert body(api.get("/api/v1/conflicts?mine=true", token=outsider.token))["items"] == []
    detail = body(api.get(f"/api/v1/conflicts/{conflict.pk}", token=operator.token))
    assert detail["base"]["etag"] == '"41"' and detail["current"]["etag"] == '"42"'
    assert any(row["path"] == "/severity" for row in detail["fields"])
    seen_by_agent = body(api.get(f"/api/v1/actions/{action.pk}", token=run.token))
    assert seen_by_agent["status"] == "conflict"
    assert seen_by_agent["conflict"]["conflict_id"] == str(conflict.pk)
    assert seen_by_agent["conflict"]["retryable_by_agent"] is False
    assert (
        api.post(
            f"/api/v1/conflicts/{conflict.pk}/resolution",
            token=outsider.token,
            body={"choice": "keep_current"},
        ).status_code
        == 404
    )
    resolved = api.post(
        f"/api/v1/conflicts/{conflict.pk}/resolution",
        token=operator.token,
        body={"choice": "keep_current", "comment": "sms is right"},
    )
    assert resolved.status_code == 200, resolved.content
    assert body(resolved)["status"] == "resolved"
    assert body(api.get(f"/api/v1/actions/{action.pk}", token=run.token))["resolution"] == (
        "keep_current"
    )


# --- catalog, audit, kill switch -------------------------------------------------------


def test_admins_edit_conflict_classes_and_kinds(api: Any, admin: Any, operator: Any) -> None:
    payload = {
        "name": "Rotate a secret",
        "approval_mode": "per_call",
        "on_conflict": "request_review",
        "resolver": "group:security",
        "quorum": 2,
    }
    created = api.put("/api/v1/conflict-classes/rotate_secret", token=admin.token, body=payload)
    assert created.status_code == 201, created.content
    replaced = api.put("/api/v1/conflict-classes/rotate_secret", token=admin.token, body=payload)
    assert replaced.status_code == 200
    assert (
        api.put("/api/v1/conflict-classes/rotate_secret", token=operator.token, body=payload)
    ).status_code == 403
    slugs = [
        c["slug"] for c in body(api.get("/api/v1/conflict-classes", token=operator.token))["items"]
    ]
    assert "rotate_secret" in slugs and "add_unique" in slugs
    kind = {
        "classes": {"create": "add_unique", "update": "rotate_secret", "delete": "rotate_secret"},
        "owner_group": "security",
        "undo_window_seconds": 120,
    }
    assert api.put("/api/v1/resource-kinds/secret", token=admin.token, body=kind).status_code == 201
    shown = body(api.get("/api/v1/resource-kinds/secret", token=operator.token))
    assert shown["classes"]["update"] == "rotate_secret" and shown["undo_window_seconds"] == 120
    bad = dict(kind, classes={"create": "nope", "update": "nope", "delete": "nope"})
    assert api.put("/api/v1/resource-kinds/secret", token=admin.token, body=bad).status_code == 422
    assert AuditEvent.objects.filter(event_type__startswith="conflict_class.").count() == 2


def test_audit_is_listed_and_verified_for_auditors_only(
    api: Any, run: Any, prod_alerts: Any, auditor: Any, outsider: Any
) -> None:
    propose(api, run)
    page = body(
        api.get("/api/v1/audit?resource=notification-policy/prod-alerts", token=auditor.token)
    )
    # Newest first: the per-call approval opened after the proposal.
    assert [e["event_type"] for e in page["items"]][:2] == ["approval.requested", "action.proposed"]
    assert all(e["resource"] == "notification-policy/prod-alerts" for e in page["items"])
    verify = body(api.get("/api/v1/audit/verify", token=auditor.token))
    assert verify["ok"] is True and verify["first_bad_seq"] is None and verify["events"] >= 1
    assert api.get("/api/v1/audit", token=outsider.token).status_code == 403


def test_the_kill_switch_is_read_by_anyone_and_set_by_operators(
    api: Any, agent: Any, operator: Any, outsider: Any
) -> None:
    engage = {"engaged": True, "scope": "*", "reason": "incident"}
    assert api.post("/api/v1/kill-switch", token=outsider.token, body=engage).status_code == 403
    response = api.post("/api/v1/kill-switch", token=operator.token, body=engage)
    assert response.status_code == 200
    switches = body(api.get("/api/v1/kill-switch", token=agent.token))["switches"]
    assert switches == [
        {"scope": "*", "engaged": True, "reason": "incident", "by": "ana", "at": switches[0]["at"]}
    ]
    no_reason = api.post(
        "/api/v1/kill-switch", token=operator.token, body={"engaged": True, "scope": "*"}
    )
    assert no_reason.status_code == 422


# --- documentation and operations -------------------------------------------------------


def test_the_openapi_document_describes_headers_errors_and_problems(api: Any) -> None:
    raw = api.get("/api/v1/openapi.json").content

    def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        assert len(keys) == len(set(keys)), keys  # YAML-based clients reject duplicates
        return dict(pairs)

    document = json.loads(raw, object_pairs_hook=no_duplicate_keys)
    assert document["openapi"].startswith("3.1")
    patch_op = document["paths"]["/api/v1/resources/{kind}/{name}"]["patch"]
    names = {p["name"] for p in patch_op["parameters"]}
    assert {"If-Match", "Idempotency-Key", "Airlock-Reason"} <= names
    assert {"202", "400", "401", "403", "409", "412", "422", "428", "429"} <= set(
        patch_op["responses"]
    )
    assert "application/problem+json" in patch_op["responses"]["412"]["content"]
    get_action = document["paths"]["/api/v1/actions/{action_id}"]["get"]
    assert {"Prefer", "If-None-Match"} <= {p["name"] for p in get_action["parameters"]}
    assert "304" in get_action["responses"]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if operation.get("security"):
                assert "401" in operation["responses"], (method, path)
    problem = document["components"]["schemas"]["Problem"]
    assert {"type", "title", "status", "detail", "code", "retryable"} <= set(problem["required"])


def test_the_docs_page_works_offline_under_the_csp(api: Any) -> None:
    page = api.get("/api/v1/docs")
    assert page.status_code == 200
    html = page.content.decode()
    assert "cdn" not in html.lower() and "https://" not in html
    assert "<script>" not in html  # no inline script; the JSON block is data
    assert "script-src 'self'" in page["Content-Security-Policy"]
    for asset in ("swagger-ui.css", "swagger-ui-bundle.js", "swagger-ui-init.js"):
        response = api.get(f"/api/v1/docs/assets/{asset}")
        assert response.status_code == 200
        assert b"".join(response.streaming_content)


def test_healthz_names_what_is_down(api: Any, settings: Any) -> None:
    healthy = api.get("/healthz")
    assert healthy.status_code == 200
    assert body(healthy) == {"database": "ok", "redis": "ok"}
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    down = api.get("/healthz")
    assert down.status_code == 503
    assert down["Content-Type"].startswith("application/problem+json")
    assert body(down)["database"] == "ok" and body(down)["redis"].startswith("down")


def test_metrics_are_prometheus_text_and_optionally_protected(
    api: Any, run: Any, prod_alerts: Any, settings: Any
) -> None:
    propose(api, run)
    text = api.get("/metrics").content.decode()
    assert 'airlock_actions{status="pending_approval"} 1' in text
    assert "airlock_http_request_duration_seconds_bucket" in text
    assert "airlock_approval_latency_seconds_count" in text
    assert "airlock_execution_latency_seconds_count" in text
    settings.METRICS_TOKEN = "m-secret"
    assert api.get("/metrics").status_code == 401
    assert api.get("/metrics", headers={"Authorization": "Bearer m-secret"}).status_code == 200


def test_another_agents_run_token_cannot_read_or_cancel_its_actions(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    action = body(propose(api, run))
    other = make_agent_with_token("other-bot")
    assert api.post(f"/api/v1/actions/{action['id']}/cancel", token=other.token).status_code == 404


def test_operators_revoke_a_run(api: Any, run: Any, operator: Any, outsider: Any) -> None:
    url = f"/api/v1/runs/{run.run.pk}/revoke"
    assert api.post(url, token=outsider.token, body={"reason": "x"}).status_code == 403
    assert api.post(url, token=run.token, body={"reason": "x"}).status_code == 403
    revoked = api.post(url, token=operator.token, body={"reason": "leaked token"})
    assert revoked.status_code == 200
    assert body(revoked)["status"] == "revoked"
    assert body(revoked)["status_reason"] == "leaked token"
    again = api.post(url, token=operator.token, body={"reason": "again"})
    assert again.status_code == 200
    assert AuditEvent.objects.filter(event_type="run.revoked").count() == 1
