"""Runs: creation, the write-set overlap matrix, race-free activation, heartbeat,
finish and expiry."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from approvals.models import Action, AutoApproveRule, IdempotencyRecord, Run
from approvals.services.runs import run_expire_due
from approvals.services.write_sets import lock_kinds, names_overlap
from audit.models import AuditEvent
from ownership.models import OwnershipRecord
from tests.fixtures.api import (
    PROD_ALERTS,
    ApiClient,
    ensure_api_kinds,
    make_active_run,
    make_agent_with_token,
)


@pytest.mark.django_db
def test_a_run_is_created_pending_with_a_token_and_a_run_approval(api: Any, agent: Any) -> None:
    response = api.create_run(
        agent.token,
        [{"resource": "notification-policy/prod-alerts", "operations": ["update"]}],
        ttl_seconds=600,
    )
    assert response.status_code == 201, response.content
    body = json.loads(response.content)
    assert body["status"] == "pending_approval"
    assert body["token"].startswith("rt_")
    assert body["url"] == f"/api/v1/runs/{body['id']}"
    assert response["Location"] == body["url"]
    run = Run.objects.get(pk=body["id"])
    assert run.token_hash != body["token"] and body["token"] not in json.dumps(run.write_set)
    assert run.approvals.filter(subject="run", status="pending").count() == 1
    assert not OwnershipRecord.objects.filter(run=run).exists()
    # the token identifies the run even before it is active
    me = api.get("/api/v1/whoami", token=body["token"])
    assert json.loads(me.content)["principal"] == "run"
    assert not AuditEvent.objects.filter(details__icontains=body["token"]).exists()


@pytest.mark.django_db
def test_a_run_covered_by_auto_approve_rules_is_active_at_once(api: Any, agent: Any) -> None:
    AutoApproveRule.objects.create(
        kind_id="dns-record", name_prefix="sandbox-", operations=["create", "update"]
    )
    response = api.create_run(
        agent.token, [{"resource": "dns-record/sandbox-*", "operations": ["create"]}]
    )
    body = json.loads(response.content)
    assert body["status"] == "active"
    assert OwnershipRecord.objects.filter(run_id=body["id"], active=True).count() == 1
    assert AuditEvent.objects.filter(event_type="run.auto_approved", run_id=body["id"]).exists()
    # not every entry covered -> pending
    response = api.create_run(
        agent.token,
        [
            {"resource": "dns-record/sandbox-b", "operations": ["delete"]},
        ],
    )
    assert json.loads(response.content)["status"] == "pending_approval"


@pytest.mark.parametrize(
    ("held", "requested", "overlaps"),
    [
        ("prod-alerts", "prod-alerts", True),
        ("prod-alerts", "prod-alerts-2", False),
        ("staging-*", "staging-eu", True),
        ("staging-eu", "staging-*", True),
        ("staging-*", "stag*", True),
        ("stag*", "staging-*", True),
        ("staging-*", "prod-*", False),
        ("*", "anything", True),
        ("staging-eu", "staging-e", False),
    ],
)
def test_names_overlap_matrix(held: str, requested: str, overlaps: bool) -> None:
    a_prefix, b_prefix = held.endswith("*"), requested.endswith("*")
    assert names_overlap(held.rstrip("*"), a_prefix, requested.rstrip("*"), b_prefix) is overlaps
    assert names_overlap(requested.rstrip("*"), b_prefix, held.rstrip("*"), a_prefix) is overlaps


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("held", "requested", "conflict"),
    [
        (
            ("notification-policy/prod-alerts", ["update"]),
            ("notification-policy/prod-alerts", ["update"]),
            True,
        ),
        (
            ("notification-policy/prod-alerts", ["update"]),
            ("notification-policy/prod-alerts", ["delete"]),
            False,
        ),
        (
            ("notification-policy/staging-*", ["create"]),
            ("notification-policy/staging-eu", ["create", "update"]),
            True,
        ),
        (
            ("notification-policy/staging-*", ["create"]),
            ("notification-policy/staging-eu", ["update"]),
            False,
        ),
        (
            ("notification-policy/staging-eu", ["delete"]),
            ("notification-policy/staging-*", ["delete"]),
            True,
        ),
        (
            ("notification-policy/staging-*", ["update"]),
            ("notification-policy/st*", ["update"]),
            True,
        ),
        (
            ("notification-policy/staging-*", ["update"]),
            ("notification-policy/prod-*", ["update"]),
            False,
        ),
        (
            ("notification-policy/staging-*", ["update"]),
            ("dns-record/staging-*", ["update"]),
            False,
        ),
    ],
    ids=[
        "exact-same-op",
        "exact-other-op",
        "prefix-vs-exact",
        "prefix-vs-exact-other-op",
        "exact-vs-prefix",
        "prefix-vs-prefix",
        "disjoint-prefixes",
        "other-kind",
    ],
)
def test_write_set_overlap_matrix(
    api: Any,
    agent: Any,
    held: tuple[str, list[str]],
    requested: tuple[str, list[str]],
    conflict: bool,
) -> None:
    make_active_run(agent.agent, [{"resource": held[0], "operations": held[1]}])
    response = api.create_run(agent.token, [{"resource": requested[0], "operations": requested[1]}])
    if conflict:
        assert response.status_code == 409, response.content
        assert json.loads(response.content)["overlaps"][0]["resource"] == held[0]
    else:
        assert response.status_code == 201, response.content


@pytest.mark.django_db
def test_expired_and_finished_runs_hold_no_authority(api: Any, agent: Any) -> None:
    write_set = [{"resource": "notification-policy/prod-alerts", "operations": ["update"]}]
    expired = make_active_run(agent.agent, write_set)
    Run.objects.filter(pk=expired.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    # Not yet marked by housekeeping, already powerless.
    assert api.create_run(agent.token, write_set).status_code == 201
    finished_agent = make_agent_with_token("finisher")
    other_set = [{"resource": "notification-policy/other", "operations": ["update"]}]
    finished = make_active_run(finished_agent.agent, other_set)
    assert (
        api.post(f"/api/v1/runs/{finished.run.pk}/finish", token=finished.token).status_code == 200
    )
    assert api.create_run(agent.token, other_set).status_code == 201


@pytest.mark.django_db
def test_activation_rechecks_overlaps(agent: Any) -> None:
    from approvals.services.runs import run_activate, run_create
    from approvals.services.write_sets import WriteSetConflict
    from audit.services import Actor

    write_set = [{"resource": "notification-policy/prod-alerts", "operations": ["update"]}]
    pending, _ = run_create(
        agent=agent.agent,
        task="a",
        write_set=write_set,
        ttl_seconds=600,
        actor=Actor.agent(agent.agent),
    )
    make_active_run(make_agent_with_token("quick-bot").agent, write_set)
    with pytest.raises(WriteSetConflict):
        run_activate(run=pending, actor=Actor.system("tests"))
    pending.refresh_from_db()
    assert pending.status == "pending_approval"
    assert not OwnershipRecord.objects.filter(run=pending).exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_overlapping_creations_never_both_become_active() -> None:
    ensure_api_kinds()
    AutoApproveRule.objects.create(
        kind_id="dns-record", name_prefix="", operations=["create", "update", "delete"]
    )
    agents = [make_agent_with_token(f"bot-{n}") for n in range(8)]
    barrier = threading.Barrier(len(agents))
    statuses: list[int] = []
    lock = threading.Lock()

    def create(token: str) -> None:
        try:
            barrier.wait(timeout=10)
            response = ApiClient().create_run(
                token, [{"resource": "dns-record/app-*", "operations": ["update"]}]
            )
            with lock:
                statuses.append(response.status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=create, args=(a.token,)) for a in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(statuses) == [201] + [409] * 7
    assert Run.objects.filter(status="active").count() == 1
    assert OwnershipRecord.objects.filter(active=True).count() == 1


@pytest.mark.django_db
def test_heartbeat_extends_but_never_past_the_maximum(api: Any, agent: Any, settings: Any) -> None:
    run = make_active_run(agent.agent, ttl_seconds=600)
    Run.objects.filter(pk=run.run.pk).update(
        expires_at=timezone.now() + timedelta(seconds=60),
        max_expires_at=timezone.now() + timedelta(seconds=300),
    )
    response = api.post(f"/api/v1/runs/{run.run.pk}/heartbeat", token=run.token)
    assert response.status_code == 200, response.content
    run.run.refresh_from_db()
    assert run.run.expires_at == run.run.max_expires_at
    record = OwnershipRecord.objects.filter(run=run.run).first()
    assert record is not None and record.expires_at == run.run.expires_at
    # the agent's token may heartbeat too; another agent's may not see the run
    assert api.post(f"/api/v1/runs/{run.run.pk}/heartbeat", token=agent.token).status_code == 200
    other = make_agent_with_token("nosy-bot")
    assert api.post(f"/api/v1/runs/{run.run.pk}/heartbeat", token=other.token).status_code == 404


@pytest.mark.django_db
def test_finish_frees_ownership_cancels_open_actions_and_is_idempotent(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    action_id = api.accepted_write(run.token, "patch", PROD_ALERTS, {"a": 1}, if_match='"41"')["id"]
    assert api.post(f"/api/v1/runs/{run.run.pk}/finish", token=run.token).status_code == 200
    assert not OwnershipRecord.objects.filter(run=run.run, active=True).exists()
    assert Action.objects.get(pk=action_id).status == "cancelled"
    events = AuditEvent.objects.filter(event_type="run.finished").count()
    again = api.post(f"/api/v1/runs/{run.run.pk}/finish", token=run.token)
    assert again.status_code == 200
    assert json.loads(again.content)["status"] == "finished"
    assert AuditEvent.objects.filter(event_type="run.finished").count() == events == 1


@pytest.mark.django_db
def test_expiry_ends_the_run_and_its_unexecuted_actions(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    action_id = api.accepted_write(run.token, "patch", PROD_ALERTS, {"a": 1}, if_match='"41"')["id"]
    Run.objects.filter(pk=run.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    # an expired run writes nothing, even before housekeeping runs
    refused = api.write(run.token, "patch", PROD_ALERTS, {"a": 2}, if_match='"41"')
    assert refused.status_code == 409
    assert json.loads(refused.content)["run_status"] == "expired"
    assert run_expire_due() == 1
    assert run_expire_due() == 0
    assert Run.objects.get(pk=run.run.pk).status == "expired"
    assert Action.objects.get(pk=action_id).status == "expired"
    assert not OwnershipRecord.objects.filter(run=run.run, active=True).exists()


@pytest.mark.django_db
def test_runs_are_listed_per_principal_with_cursor_pagination(
    api: Any, agent: Any, operator: Any, outsider: Any
) -> None:
    for n in range(5):
        make_active_run(agent.agent, [{"resource": f"dns-record/x{n}", "operations": ["create"]}])
    seen: list[str] = []
    url = "/api/v1/runs?limit=2"
    while url:
        page = json.loads(api.get(url, token=agent.token).content)
        seen += [item["id"] for item in page["items"]]
        url = f"/api/v1/runs?limit=2&cursor={page['next']}" if page["next"] else ""
    assert len(seen) == len(set(seen)) == 5
    assert len(json.loads(api.get("/api/v1/runs", token=operator.token).content)["items"]) == 5
    assert json.loads(api.get("/api/v1/runs", token=outsider.token).content)["items"] == []


# --- POST /runs with an Idempotency-Key: a lost answer never makes a second run ---------

ALERTS_WRITE_SET = [{"resource": "notification-policy/prod-alerts", "operations": ["update"]}]


def create_keyed(api: Any, token: str, key: str, *, task: str = "keyed") -> Any:
    body = {"task": task, "write_set": ALERTS_WRITE_SET}
    return api.post("/api/v1/runs", token=token, body=body, headers={"Idempotency-Key": key})


@pytest.mark.django_db
def test_the_same_key_and_body_replay_the_first_run_with_its_token(api: Any, agent: Any) -> None:
    first = create_keyed(api, agent.token, "run-key-00001")
    assert first.status_code == 201, first.content
    events = AuditEvent.objects.count()
    again = create_keyed(api, agent.token, "run-key-00001")
    assert again.status_code == 201
    assert again.content == first.content  # the same run, the same token, the same bytes
    assert again["Location"] == first["Location"]
    assert again["Idempotent-Replayed"] == "true" and not first.has_header("Idempotent-Replayed")
    assert Run.objects.filter(agent=agent.agent).count() == 1
    assert AuditEvent.objects.count() == events
    # The replayed token works; the stored answer never holds it readable.
    token = json.loads(again.content)["token"]
    assert json.loads(api.get("/api/v1/whoami", token=token).content)["principal"] == "run"
    record = IdempotencyRecord.objects.get(key="run-key-00001")
    assert token.encode() not in bytes(record.response_body or b"")
    assert token not in json.dumps(record.response_headers)
    # Without a key, every POST is a new run (the header stays optional).
    assert api.create_run(agent.token, ALERTS_WRITE_SET).status_code == 201
    assert Run.objects.filter(agent=agent.agent).count() == 2


@pytest.mark.django_db
def test_the_same_key_with_another_body_or_endpoint_is_refused_and_creates_nothing(
    api: Any, agent: Any, prod_alerts: Any
) -> None:
    assert create_keyed(api, agent.token, "run-key-00002", task="first").status_code == 201
    other = create_keyed(api, agent.token, "run-key-00002", task="second")
    assert other.status_code == 422
    assert json.loads(other.content)["code"] == "idempotency_key_reused"
    assert Run.objects.filter(agent=agent.agent).count() == 1
    # A key is the agent's: one used by its run's write is refused on POST /runs too.
    run = make_active_run(agent.agent)
    write = api.patch(
        "/api/v1/resources/notification-policy/prod-alerts",
        token=run.token,
        body={"a": 1},
        headers={"If-Match": '"41"', "Idempotency-Key": "run-key-00003"},
    )
    assert write.status_code == 202
    reused = create_keyed(api, agent.token, "run-key-00003")
    assert reused.status_code == 422 and Run.objects.filter(agent=agent.agent).count() == 2
    # A malformed key is refused before anything happens.
    bad = create_keyed(api, agent.token, "short")
    assert bad.status_code == 400
    assert json.loads(bad.content)["code"] == "idempotency_key_invalid"
    assert Run.objects.filter(agent=agent.agent).count() == 2


@pytest.mark.django_db
def test_a_refused_run_is_not_kept_under_its_key(api: Any, agent: Any) -> None:
    make_active_run(make_agent_with_token("holder-bot").agent)  # holds prod-alerts
    refused = create_keyed(api, agent.token, "run-key-00004")
    assert refused.status_code == 409
    assert json.loads(refused.content)["code"] == "write_set_conflict"
    assert not IdempotencyRecord.objects.filter(key="run-key-00004").exists()


@pytest.mark.django_db(transaction=True)
def test_a_retry_while_the_first_post_is_still_creating_gets_409_then_the_same_run() -> None:
    """The collision forced: the first POST has claimed its key and waits inside run_create
    (another transaction holds the kind's lock); the retry arrives then."""
    ensure_api_kinds()
    agent = make_agent_with_token("retry-bot")
    locked, release = threading.Event(), threading.Event()
    first: dict[str, Any] = {}

    def hold_lock() -> None:
        try:
            with transaction.atomic():
                lock_kinds({"notification-policy"})
                locked.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    def send_first() -> None:
        try:
            first["response"] = create_keyed(ApiClient(), agent.token, "run-key-race1")
        finally:
            connection.close()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    assert locked.wait(timeout=10)
    sender = threading.Thread(target=send_first)
    sender.start()
    try:
        deadline = timezone.now() + timedelta(seconds=10)
        while not IdempotencyRecord.objects.filter(key="run-key-race1").exists():
            assert timezone.now() < deadline, "the first POST never claimed its key"
            threading.Event().wait(0.02)
        retry = create_keyed(ApiClient(), agent.token, "run-key-race1")
        assert retry.status_code == 409
        problem = json.loads(retry.content)
        assert problem["code"] == "idempotency_key_in_flight" and problem["retryable"] is True
        assert int(retry["Retry-After"]) >= 1
        changed = create_keyed(ApiClient(), agent.token, "run-key-race1", task="other")
        assert json.loads(changed.content)["code"] == "idempotency_key_reused"
    finally:
        release.set()
        holder.join(timeout=30)
        sender.join(timeout=30)
    assert first["response"].status_code == 201
    replay = create_keyed(ApiClient(), agent.token, "run-key-race1")
    assert replay.status_code == 201 and replay.content == first["response"].content
    assert Run.objects.filter(agent=agent.agent).count() == 1


@pytest.mark.django_db(transaction=True)
def test_ten_concurrent_posts_with_one_key_create_one_run() -> None:
    ensure_api_kinds()
    agent = make_agent_with_token("racing-run-bot")
    barrier = threading.Barrier(10)
    results: list[tuple[int, bytes]] = []
    lock = threading.Lock()

    def send() -> None:
        try:
            barrier.wait(timeout=10)
            response = create_keyed(ApiClient(), agent.token, "run-key-race10")
            with lock:
                results.append((response.status_code, response.content))
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 10
    assert Run.objects.filter(agent=agent.agent).count() == 1
    assert {status for status, _ in results} <= {201, 409}
    created = [body for status, body in results if status == 201]
    assert created and all(body == created[0] for body in created)
    for status, body in results:
        if status == 409:
            assert json.loads(body)["code"] == "idempotency_key_in_flight"
    assert AuditEvent.objects.filter(event_type="run.created").count() == 1


@pytest.mark.django_db
def test_a_replay_after_a_secret_key_rotation_uses_the_fallback_or_answers_409(
    api: Any, agent: Any, settings: Any
) -> None:
    first = create_keyed(api, agent.token, "run-key-rotate")
    assert first.status_code == 201
    old_key = settings.SECRET_KEY
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "rotated-" + old_key, [old_key]
    again = create_keyed(api, agent.token, "run-key-rotate")
    assert again.status_code == 201 and again.content == first.content
    settings.SECRET_KEY_FALLBACKS = []
    lost = create_keyed(api, agent.token, "run-key-rotate")
    assert lost.status_code == 409
    problem = json.loads(lost.content)
    assert problem["code"] == "conflict" and json.loads(first.content)["id"] in problem["detail"]
    assert Run.objects.filter(agent=agent.agent).count() == 1
