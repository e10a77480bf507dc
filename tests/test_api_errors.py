"""One test per row of the contract's error table: status, code, retryable, and
that nothing changed (actions, audit events, resource version, idempotency records)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, IdempotencyRecord
from audit.models import AuditEvent
from audit.services import Actor
from ownership.models import OwnershipRecord, Resource
from tests.fixtures.api import make_active_run, make_agent_with_token

pytestmark = pytest.mark.django_db

PROD = "/api/v1/resources/notification-policy/prod-alerts"


@dataclass
class Snapshot:
    actions: int
    audit: int
    version: int
    idempotency: int

    @classmethod
    def take(cls) -> Snapshot:
        resource = Resource.objects.get(kind_id="notification-policy", name="prod-alerts")
        return cls(
            actions=Action.objects.count(),
            audit=AuditEvent.objects.count(),
            version=resource.version,
            idempotency=IdempotencyRecord.objects.count(),
        )


def problem(response: Any, status: int, code: str, retryable: bool) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    body: dict[str, Any] = json.loads(response.content)
    assert body["code"] == code
    assert body["retryable"] is retryable
    assert body["status"] == status
    assert body["type"] == f"/api/v1/problems/{code}"
    assert body["title"] and body["detail"]
    return body


def patch_prod(api: Any, token: str | None, **headers: str) -> Any:
    all_headers = {"If-Match": '"41"', "Idempotency-Key": "key-error-table-1"}
    all_headers.update(headers)
    return api.patch(PROD, token=token, body={"channels": ["email", "pager"]}, headers=all_headers)


def test_no_token_is_401_unauthenticated(api: Any, run: Any, prod_alerts: Any) -> None:
    before = Snapshot.take()
    problem(patch_prod(api, None), 401, "unauthenticated", False)
    problem(patch_prod(api, "rt_not-a-real-token-at-all-000000"), 401, "unauthenticated", False)
    assert Snapshot.take() == before


def test_a_revoked_or_expired_token_is_401(api: Any, agent: Any, operator: Any) -> None:
    from approvals.models import AgentToken, PersonalToken

    assert api.get("/api/v1/runs", token=agent.token).status_code == 200
    AgentToken.objects.filter(agent=agent.agent).update(revoked_at=timezone.now())
    problem(api.get("/api/v1/runs", token=agent.token), 401, "unauthenticated", False)
    PersonalToken.objects.filter(user=operator.user).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    problem(api.get("/api/v1/approvals", token=operator.token), 401, "unauthenticated", False)


def test_an_agent_token_cannot_write_403_forbidden(
    api: Any, agent: Any, run: Any, prod_alerts: Any
) -> None:
    before = Snapshot.take()
    problem(patch_prod(api, agent.token), 403, "forbidden", False)
    assert Snapshot.take() == before


def test_a_person_without_the_role_cannot_decide_403(
    api: Any, outsider: Any, run: Any, prod_alerts: Any
) -> None:
    response = patch_prod(api, run.token)
    approval_id = json.loads(response.content)["approval"]["approval_id"]
    before = Snapshot.take()
    problem(
        api.decide(approval_id, "approve", token=outsider.token),
        403,
        "forbidden",
        False,
    )
    assert Snapshot.take() == before


def test_unknown_resource_is_404_not_found(api: Any, run: Any, prod_alerts: Any) -> None:
    before = Snapshot.take()
    problem(
        api.get("/api/v1/resources/notification-policy/nope", token=run.token),
        404,
        "not_found",
        False,
    )
    problem(
        api.patch(
            "/api/v1/resources/notification-policy/staging-nope",
            token=run.token,
            body={"a": 1},
            headers={"If-Match": '"1"', "Idempotency-Key": "key-missing-1"},
        ),
        404,
        "not_found",
        False,
    )
    assert Snapshot.take() == before


def test_another_agents_action_is_404(api: Any, run: Any, prod_alerts: Any) -> None:
    action_id = json.loads(patch_prod(api, run.token).content)["id"]
    other = make_agent_with_token("other-bot")
    problem(api.get(f"/api/v1/actions/{action_id}", token=other.token), 404, "not_found", False)


def test_malformed_json_is_400_validation_error(api: Any, run: Any, prod_alerts: Any) -> None:
    before = Snapshot.take()
    response = api.patch(
        PROD,
        token=run.token,
        raw=b'{"channels": [',
        headers={"If-Match": '"41"', "Idempotency-Key": "key-bad-json-1"},
    )
    problem(response, 400, "validation_error", False)
    assert Snapshot.take() == before


def test_well_formed_invalid_body_is_422_with_field_errors(api: Any, agent: Any) -> None:
    before_audit = AuditEvent.objects.count()
    response = api.post(
        "/api/v1/runs",
        token=agent.token,
        body={"task": "x", "write_set": [{"resource": "no-such-kind/x", "operations": ["update"]}]},
    )
    body = problem(response, 422, "validation_error", False)
    assert body["errors"][0]["field"] == "write_set[0].resource"
    response = api.post(
        "/api/v1/runs",
        token=agent.token,
        body={"task": "x", "write_set": [], "surprise": True},
    )
    body = problem(response, 422, "validation_error", False)
    fields = {error["field"] for error in body["errors"]}
    assert any("surprise" in field for field in fields)
    assert AuditEvent.objects.count() == before_audit


def test_a_write_outside_the_write_set_is_403_not_in_write_set(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    before = Snapshot.take()
    response = api.put(
        "/api/v1/resources/notification-policy/prod-alerts-2",
        token=run.token,
        body={"a": 1},
        headers={"If-None-Match": "*", "Idempotency-Key": "key-outside-1"},
    )
    problem(response, 403, "not_in_write_set", False)
    # prod-alerts is declared for update/delete, not create
    response = api.put(
        PROD,
        token=run.token,
        body={"a": 1},
        headers={"If-None-Match": "*", "Idempotency-Key": "key-outside-2"},
    )
    problem(response, 403, "not_in_write_set", False)
    assert Snapshot.take() == before


def test_a_write_by_a_finished_run_is_409_run_not_active(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    finished = api.post(f"/api/v1/runs/{run.run.pk}/finish", token=run.token)
    assert finished.status_code == 200
    before = Snapshot.take()
    body = problem(patch_prod(api, run.token), 409, "run_not_active", False)
    assert body["run_status"] == "finished"
    assert Snapshot.take() == before


def test_an_overlapping_write_set_is_409_naming_every_overlap(
    api: Any, agent: Any, run: Any
) -> None:
    before_audit = AuditEvent.objects.count()
    response = api.post(
        "/api/v1/runs",
        token=agent.token,
        body={
            "task": "collide",
            "write_set": [
                {"resource": "notification-policy/prod-alerts", "operations": ["update"]},
                {"resource": "notification-policy/staging-eu", "operations": ["delete"]},
                {"resource": "dns-record/app-*", "operations": ["create"]},
            ],
        },
    )
    body = problem(response, 409, "write_set_conflict", False)
    held = {(o["resource"], o["requested"], tuple(o["operations"])) for o in body["overlaps"]}
    assert held == {
        ("notification-policy/prod-alerts", "notification-policy/prod-alerts", ("update",)),
        ("notification-policy/staging-*", "notification-policy/staging-eu", ("delete",)),
        ("dns-record/app-*", "dns-record/app-*", ("create",)),
    }
    assert all(o["run"] == str(run.run.pk) and o["agent"] == "deploy-bot" for o in body["overlaps"])
    assert AuditEvent.objects.count() == before_audit


def test_another_runs_exclusive_lease_is_423_leased(api: Any, run: Any, prod_alerts: Any) -> None:
    # The real path: a write-set entry with "lease": true becomes an exclusive,
    # fenced ownership record when the run becomes active. `run` holds
    # update/delete on prod-alerts, the leaseholder only create (no overlap).
    other = make_active_run(
        make_agent_with_token("lease-bot").agent,
        [{"resource": "notification-policy/prod-alerts", "operations": ["create"], "lease": True}],
    )
    lease = OwnershipRecord.objects.get(run=other.run, exclusive=True)
    assert lease.fence is not None and lease.expires_at == other.run.expires_at
    before = Snapshot.take()
    body = problem(patch_prod(api, run.token), 423, "leased", True)
    assert body["lease"] == {
        "run": str(other.run.pk),
        "expires_at": other.run.expires_at.isoformat(),
    }
    assert Snapshot.take() == before


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({"Idempotency-Key": "key-no-match-1"}, 428, "precondition_required"),
        ({"If-Match": '"41"'}, 400, "idempotency_key_missing"),
    ],
    ids=["without-if-match-428", "without-idempotency-key-400"],
)
def test_a_write_without_a_required_header_is_refused_and_changes_nothing(
    api: Any, run: Any, prod_alerts: Any, headers: dict[str, str], status: int, code: str
) -> None:
    before = Snapshot.take()
    response = api.patch(PROD, token=run.token, body={"a": 1}, headers=headers)
    problem(response, status, code, False)
    assert Snapshot.take() == before


def test_a_stale_if_match_is_412_and_audited_with_the_run(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    before = Snapshot.take()
    body = problem(patch_prod(api, run.token, **{"If-Match": '"40"'}), 412, "stale_version", False)
    assert body["resource"] == "notification-policy/prod-alerts"
    assert body["expected_etag"] == '"40"'
    assert body["current_etag"] == '"41"'
    assert body["conflict_class"] == "replace_shared_document"
    assert body["resolver"] == "group:operators"
    after = Snapshot.take()
    assert (after.actions, after.version) == (before.actions, before.version)
    event = AuditEvent.objects.order_by("-seq").first()
    assert event is not None and event.event_type == "action.refused_stale"
    assert event.actor_type == "run" and event.actor_id == str(run.run.pk)
    assert event.run_id == run.run.pk


def test_a_malformed_key_is_400_idempotency_key_invalid(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    before = Snapshot.take()
    for key in ("short", "has spaces in it", "x" * 256, "ünïcode-key"):
        problem(
            patch_prod(api, run.token, **{"Idempotency-Key": key}),
            400,
            "idempotency_key_invalid",
            False,
        )
    assert Snapshot.take() == before


def test_a_reused_key_with_another_body_is_422_idempotency_key_reused(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    assert patch_prod(api, run.token).status_code == 202
    before = Snapshot.take()
    response = api.patch(
        PROD,
        token=run.token,
        body={"channels": ["sms"]},
        headers={"If-Match": '"41"', "Idempotency-Key": "key-error-table-1"},
    )
    problem(response, 422, "idempotency_key_reused", False)
    assert Snapshot.take() == before


def test_a_key_in_flight_is_409_with_retry_after(api: Any, run: Any, prod_alerts: Any) -> None:
    from approvals.services.idempotency import idempotency_begin, request_fingerprint

    body = json.dumps({"channels": ["email", "pager"]}).encode()
    idempotency_begin(
        actor=Actor.agent(run.agent),
        key="key-error-table-1",
        method="PATCH",
        path=PROD,
        fingerprint=request_fingerprint(method="PATCH", path=PROD, body=body),
    )
    before = Snapshot.take()
    response = patch_prod(api, run.token)
    problem(response, 409, "idempotency_key_in_flight", True)
    assert int(response["Retry-After"]) >= 1
    assert Snapshot.take() == before


def test_an_engaged_kill_switch_pauses_a_write_instead_of_503(
    api: Any, run: Any, operator: Any
) -> None:
    """kill_switch_engaged (503) is only for requests that would execute at once;
    no v1 endpoint executes a write in the request, so a write is recorded
    `paused` with the reason and resumes on release."""
    from tests.fixtures.core import make_resource

    make_resource("dns-record/app-web", {"ip": "10.0.0.1"}, version=3)
    response = api.post(
        "/api/v1/kill-switch",
        token=operator.token,
        body={"engaged": True, "scope": "dns-record/*", "reason": "incident 42"},
    )
    assert response.status_code == 200, response.content
    body = api.accepted_write(
        run.token, "patch", "dns-record/app-web", {"ip": "10.0.0.2"}, if_match='"3"'
    )
    assert body["status"] == "paused"
    assert body["paused_reason"] == "incident 42"


def test_undo_after_the_deadline_is_409_undo_window_expired(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    from approvals.models import Operation
    from tests.fixtures.core import applied_prod_alerts_action

    action = applied_prod_alerts_action(run.run)
    Operation.objects.filter(action=action).update(
        undo_deadline=timezone.now() - timedelta(seconds=1)
    )
    before = Snapshot.take()
    response = api.undo(action.pk, token=run.token, key="key-undo-late-1")
    problem(response, 409, "undo_window_expired", False)
    assert Snapshot.take() == before


def test_too_many_writes_is_429_with_retry_after(
    api: Any, run: Any, prod_alerts: Any, settings: Any
) -> None:
    settings.AIRLOCK_WRITE_RATE_PER_MINUTE = 2
    statuses = [
        patch_prod(api, run.token, **{"Idempotency-Key": f"key-rate-{n:04d}"}).status_code
        for n in range(2)
    ]
    assert statuses == [202, 202]
    before = Snapshot.take()
    response = patch_prod(api, run.token, **{"Idempotency-Key": "key-rate-9999"})
    problem(response, 429, "rate_limited", True)
    assert 1 <= int(response["Retry-After"]) <= 61
    assert Snapshot.take() == before


def test_an_oversize_body_is_413_and_nothing_is_read(
    api: Any, run: Any, prod_alerts: Any, settings: Any
) -> None:
    settings.AIRLOCK_MAX_BODY_BYTES = 2048
    before = Snapshot.take()
    response = api.patch(
        PROD,
        token=run.token,
        body={"blob": "x" * 4096},
        headers={"If-Match": '"41"', "Idempotency-Key": "key-too-big-1"},
    )
    problem(response, 413, "payload_too_large", False)
    assert Snapshot.take() == before


@pytest.mark.parametrize(
    "if_match",
    ['W/"41"', '"41", *', "41", '"41" "42"', ""],
    ids=["weak", "star-mixed", "unquoted", "no-comma", "empty"],
)
def test_bad_or_weak_if_match(api: Any, run: Any, prod_alerts: Any, if_match: str) -> None:
    before = Snapshot.take()
    response = patch_prod(api, run.token, **{"If-Match": if_match})
    if if_match == 'W/"41"':
        # Well-formed, but a write names one strong tag: refused before anything is
        # recorded (issue 9 item 1; it used to be a recorded 412).
        problem(response, 400, "if_match_invalid", False)
    else:
        problem(response, 400, "bad_header", False)
    assert Snapshot.take() == before


def test_unknown_paths_and_methods_under_the_api_are_problem_json(api: Any, agent: Any) -> None:
    problem(api.get("/api/v1/no-such-thing", token=agent.token), 404, "not_found", False)
    problem(api.delete("/api/v1/runs", token=agent.token), 405, "method_not_allowed", False)
