"""The idempotency matrix: replay, fingerprint mismatches, concurrency, stale retries,
what is and is not stored, retention and pruning."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from approvals.models import Action, IdempotencyRecord
from approvals.services.idempotency import idempotency_prune
from audit.models import AuditEvent
from ownership.models import Resource
from tests.fixtures.api import ApiClient, make_active_run, make_agent_with_token
from tests.fixtures.core import make_resource

pytestmark = pytest.mark.django_db

PROD = "/api/v1/resources/notification-policy/prod-alerts"
BODY = {"channels": ["email", "pager"]}


def patch(api: Any, token: str, *, body: Any = BODY, path: str = PROD, **headers: str) -> Any:
    all_headers = {"If-Match": '"41"', "Idempotency-Key": "key-matrix-0001"}
    all_headers.update(headers)
    return api.patch(path, token=token, body=body, headers=all_headers)


def test_a_replay_answers_the_stored_response_byte_for_byte(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    first = patch(api, run.token)
    assert first.status_code == 202
    actions, audit = Action.objects.count(), AuditEvent.objects.count()
    again = patch(api, run.token)
    assert again.status_code == 202
    assert again.content == first.content
    for header in ("Location", "ETag", "Content-Type"):
        assert again[header] == first[header]
    assert again["Idempotent-Replayed"] == "true"
    assert not first.has_header("Idempotent-Replayed")
    assert (Action.objects.count(), AuditEvent.objects.count()) == (actions, audit)


def test_key_order_and_spacing_do_not_change_the_fingerprint(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    body = {"a": 1, "b": {"c": [1, 2]}}
    first = api.patch(
        PROD,
        token=run.token,
        raw=json.dumps(body),
        headers={"If-Match": '"41"', "Idempotency-Key": "key-canonical-1"},
    )
    again = api.patch(
        PROD,
        token=run.token,
        raw='{ "b" : {"c":[1,2]},   "a":1 }',
        headers={"If-Match": '"41"', "Idempotency-Key": "key-canonical-1"},
    )
    assert again.status_code == 202 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content


def test_the_same_key_with_a_different_body_path_or_method_is_422(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    make_resource("notification-policy/staging-eu", {"severity": "info"}, version=7)
    assert patch(api, run.token).status_code == 202
    actions = Action.objects.count()
    different_body = patch(api, run.token, body={"channels": ["sms"]})
    assert different_body.status_code == 422
    assert json.loads(different_body.content)["code"] == "idempotency_key_reused"
    different_path = patch(
        api,
        run.token,
        path="/api/v1/resources/notification-policy/staging-eu",
        **{"If-Match": '"7"'},
    )
    assert different_path.status_code == 422
    assert json.loads(different_path.content)["code"] == "idempotency_key_reused"
    different_method = api.put(
        PROD,
        token=run.token,
        body=BODY,
        headers={"If-Match": '"41"', "Idempotency-Key": "key-matrix-0001"},
    )
    assert different_method.status_code == 422
    assert json.loads(different_method.content)["code"] == "idempotency_key_reused"
    assert Action.objects.count() == actions


def test_a_retry_whose_if_match_is_now_stale_gets_the_original_202(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    first = patch(api, run.token)
    assert first.status_code == 202
    # Someone else's write lands: the resource is now at 42.
    Resource.objects.filter(pk=prod_alerts.pk).update(version=42)
    assert patch(api, run.token, **{"Idempotency-Key": "key-fresh-0001"}).status_code == 412
    retry = patch(api, run.token)
    assert retry.status_code == 202
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"


def test_keys_are_scoped_to_the_agent(api: Any, run: Any, prod_alerts: Any) -> None:
    assert patch(api, run.token).status_code == 202
    other = make_active_run(
        make_agent_with_token("other-bot").agent,
        [{"resource": "notification-policy/qa-*", "operations": ["create"]}],
    )
    response = api.put(
        "/api/v1/resources/notification-policy/qa-new",
        token=other.token,
        body={"a": 1},
        headers={"If-None-Match": "*", "Idempotency-Key": "key-matrix-0001"},
    )
    assert response.status_code == 202
    assert not response.has_header("Idempotent-Replayed")


def test_answers_before_the_layer_are_not_stored(api: Any, run: Any, prod_alerts: Any) -> None:
    # 401: no token, nothing stored
    assert patch(api, "rt_bogus-token-00000000000").status_code == 401
    # 400 malformed body and 428 missing precondition: the key stays free
    bad = api.patch(
        PROD,
        token=run.token,
        raw=b"{nope",
        headers={"If-Match": '"41"', "Idempotency-Key": "key-matrix-0001"},
    )
    assert bad.status_code == 400
    no_match = api.patch(
        PROD, token=run.token, body=BODY, headers={"Idempotency-Key": "key-matrix-0001"}
    )
    assert no_match.status_code == 428
    assert not IdempotencyRecord.objects.exists()
    good = patch(api, run.token)
    assert good.status_code == 202
    assert not good.has_header("Idempotent-Replayed")


def test_a_refused_stale_write_is_replayed_and_audited_once(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    first = patch(api, run.token, **{"If-Match": '"40"'})
    assert first.status_code == 412
    refusals = AuditEvent.objects.filter(event_type="action.refused_stale").count()
    again = patch(api, run.token, **{"If-Match": '"40"'})
    assert again.status_code == 412
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert AuditEvent.objects.filter(event_type="action.refused_stale").count() == refusals == 1


def test_records_are_kept_at_least_24_hours_then_pruned(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    assert patch(api, run.token).status_code == 202
    record = IdempotencyRecord.objects.get()
    assert record.expires_at - record.created_at >= timedelta(hours=24)
    assert idempotency_prune(now=timezone.now() + timedelta(hours=23)) == 0
    assert idempotency_prune(now=record.expires_at + timedelta(seconds=1)) == 1
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_twenty_concurrent_identical_requests_make_exactly_one_action(prod_alerts: Any) -> None:
    from tests.fixtures.api import ensure_api_kinds

    ensure_api_kinds()
    run = make_active_run(make_agent_with_token("racer-bot").agent)
    barrier = threading.Barrier(20)
    results: list[tuple[int, bytes, dict[str, str]]] = []
    lock = threading.Lock()

    def send() -> None:
        client = ApiClient()
        try:
            barrier.wait(timeout=10)
            response = patch(client, run.token, **{"Idempotency-Key": "key-race-00001"})
            with lock:
                results.append((response.status_code, response.content, dict(response.items())))
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 20
    assert Action.objects.filter(run=run.run).count() == 1
    statuses = sorted(status for status, _, _ in results)
    assert set(statuses) <= {202, 409}, statuses
    accepted = [body for status, body, _ in results if status == 202]
    assert accepted and all(body == accepted[0] for body in accepted)
    for status, body, headers in results:
        if status == 409:
            assert json.loads(body)["code"] == "idempotency_key_in_flight"
            assert int(headers["Retry-After"]) >= 1
    assert AuditEvent.objects.filter(event_type="action.proposed").count() == 1
    # Once the winner is done, a retry replays it.
    retry = patch(ApiClient(), run.token, **{"Idempotency-Key": "key-race-00001"})
    assert retry.status_code == 202 and retry.content == accepted[0]
