"""A kind whose documents are rows of a real PostgreSQL table, governed end to end (issue 39):
the kind API, reads through the target, the agent's conditional write approved and executed
by a real worker, the collision with another writer of the table, settling an unknown
outcome by reading, undo, and a credential that appears nowhere.

The table lives in a scratch database (the test database's name + `_wired`), written by the
adapter's own connections and by "someone else" — a plain psycopg connection, standing in for
the application that owns the table."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from approvals.models import Action, Operation
from audit.models import AuditEvent
from tests.fixtures.api import make_active_run, make_agent_with_token, problem
from tests.fixtures.engine import wait_for

ENV = "AIRLOCK_TEST_BILLING_DB"
PASSWORD = "Billing-Sekr1t-Pw"  # trust auth accepts it; it must never show anywhere
KIND = "billing-account"


def _url(dbname: str, *, password: bool = False) -> str:
    base = urlsplit(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/airlock"))
    netloc = base.netloc
    if password:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':')[0] or 'postgres'}:{PASSWORD}@{host}"
    return urlunsplit(base._replace(netloc=netloc, path=f"/{dbname}"))


@pytest.fixture
def billing_db(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    base = urlsplit(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/airlock"))
    dbname = f"{base.path.lstrip('/') or 'airlock'}_wired"
    with psycopg.connect(_url("postgres"), autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    with psycopg.connect(_url(dbname), autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE accounts (account_id text PRIMARY KEY, settings jsonb NOT NULL, "
            "version bigint NOT NULL, airlock_fence bigint)"
        )
        conn.execute(
            "INSERT INTO accounts VALUES ('acme', %s, 1, NULL)", [json.dumps({"seats": 5})]
        )
    monkeypatch.setenv(ENV, _url(dbname, password=True))
    yield _url(dbname)
    with psycopg.connect(_url("postgres"), autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        )


def _row(billing_db: str) -> tuple[dict[str, Any], int]:
    with psycopg.connect(billing_db) as conn:
        row = conn.execute(
            "SELECT settings, version FROM accounts WHERE account_id = 'acme'"
        ).fetchone()
    assert row is not None
    return row[0], row[1]


SETTINGS = {
    "credentials_env": ENV,
    "table": "accounts",
    "key_column": "account_id",
    "document_column": "settings",
    "version_column": "version",
    "version_type": "integer",
    "fence_column": "airlock_fence",
}


def _put_kind(api: Any, admin: Any, **changes: Any) -> Any:
    body = {
        "classes": {
            "create": "add_unique",
            "update": "recompute_field",
            "delete": "recompute_field",
        },
        "owner_group": "platform",
        "target": "postgres",
        "target_settings": SETTINGS,
        **changes,
    }
    return api.put(f"/api/v1/resource-kinds/{KIND}", token=admin.token, body=body)


def _run(write_set_name: str = "acme") -> Any:
    agent = make_agent_with_token(f"billing-bot-{uuid.uuid4().hex[:6]}")
    return make_active_run(
        agent.agent,
        [{"resource": f"{KIND}/{write_set_name}", "operations": ["create", "update", "delete"]}],
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_postgres_kind_is_governed_end_to_end_and_its_credential_shows_nowhere(
    api: Any, admin: Any, operator: Any, billing_db: str, rq_worker: Any, caplog: Any
) -> None:
    caplog.set_level("DEBUG")
    answers: list[bytes] = []
    kind = _put_kind(api, admin)
    assert kind.status_code in (200, 201), kind.content
    answers.append(kind.content)
    assert kind.json()["capabilities"] == {"holds_fence": True, "takes_idempotency_key": False}

    run = _run()
    path = f"/api/v1/resources/{KIND}/acme"
    read = api.get(path, token=run.token)
    answers.append(read.content)
    assert read.status_code == 200 and read["ETag"] == '"1"'
    assert read.json()["document"] == {"seats": 5}

    # Someone else writes the row after the agent read it: the agent's write from version 1
    # must not erase that change.
    with psycopg.connect(billing_db, autocommit=True) as conn:
        conn.execute(
            "UPDATE accounts SET settings = %s, version = 2 WHERE account_id = 'acme'",
            [json.dumps({"seats": 5, "plan": "enterprise"})],
        )
    stale = api.put(
        path,
        token=run.token,
        body={"seats": 9},
        headers={"If-Match": '"1"', "Idempotency-Key": "billing-stale-0001"},
    )
    answers.append(stale.content)
    # The mirror still holds the tag the agent sent ("1"): the proposal is accepted, and
    # the target's own conditional UPDATE refuses it at execution.
    assert stale.status_code == 202, stale.content
    worker = rq_worker(**{ENV: os.environ[ENV]})
    action_id = stale.json()["id"]
    wait_for(lambda: Action.objects.get(pk=action_id).status in ("conflict", "applied"), timeout=30)
    assert Action.objects.get(pk=action_id).status == "conflict"
    assert _row(billing_db) == ({"seats": 5, "plan": "enterprise"}, 2)  # nothing lost

    # The agent re-reads (the target's token now) and writes again: applied, once.
    again = api.get(path, token=run.token)
    assert again["ETag"] == '"2"'
    fresh = api.patch(
        path,
        token=run.token,
        body={"seats": 9},
        headers={"If-Match": '"2"', "Idempotency-Key": "billing-fresh-0001"},
        content_type="application/merge-patch+json",
    )
    answers.append(fresh.content)
    assert fresh.status_code == 202, fresh.content
    fresh_id = fresh.json()["id"]
    wait_for(lambda: Action.objects.get(pk=fresh_id).status == "applied", timeout=30)
    assert _row(billing_db) == ({"seats": 9, "plan": "enterprise"}, 3)
    operation = Operation.objects.get(action_id=fresh_id, status="done")
    assert (operation.base_version, operation.result_version) == ("2", "3")
    action_body = api.get(f"/api/v1/actions/{fresh_id}", token=run.token)
    answers.append(action_body.content)
    assert action_body.json()["execution"]["result_etag"] == '"3"'

    # Undo after someone else changed the row: a conflict for a person, never an overwrite.
    with psycopg.connect(billing_db, autocommit=True) as conn:
        conn.execute(
            "UPDATE accounts SET settings = %s, version = 4 WHERE account_id = 'acme'",
            [json.dumps({"seats": 12, "plan": "enterprise"})],
        )
    undo = api.undo(fresh_id, token=run.token, key="billing-undo-0001")
    answers.append(undo.content)
    assert undo.status_code == 202, undo.content
    wait_for(
        lambda: Operation.objects.filter(undo_of=operation, status="failed").exists(), timeout=30
    )
    assert _row(billing_db) == ({"seats": 12, "plan": "enterprise"}, 4)
    conflict = api.get("/api/v1/conflicts?limit=50", token=operator.token)
    answers.append(conflict.content)

    worker.stop()
    events = list(AuditEvent.objects.values_list("details", flat=True))
    places = [*(a.decode() for a in answers), json.dumps(events), worker.output()]
    places += [record.getMessage() for record in caplog.records]
    for place in places:
        assert PASSWORD not in place
        assert os.environ[ENV] not in place


@pytest.mark.django_db(transaction=True)
def test_undo_of_a_postgres_write_restores_the_row_conditionally(
    api: Any, admin: Any, billing_db: str, rq_worker: Any
) -> None:
    assert _put_kind(api, admin).status_code in (200, 201)
    run = _run()
    path = f"/api/v1/resources/{KIND}/acme"
    assert api.get(path, token=run.token)["ETag"] == '"1"'
    write = api.put(
        path,
        token=run.token,
        body={"seats": 7},
        headers={"If-Match": '"1"', "Idempotency-Key": "billing-undo-write-1"},
    )
    assert write.status_code == 202, write.content
    action_id = write.json()["id"]
    worker = rq_worker(**{ENV: os.environ[ENV]})
    wait_for(lambda: Action.objects.get(pk=action_id).status == "applied", timeout=30)
    assert _row(billing_db) == ({"seats": 7}, 2)
    assert api.undo(action_id, token=run.token, key="billing-undo-undo-1").status_code == 202
    wait_for(lambda: Action.objects.get(pk=action_id).status == "undone", timeout=30)
    assert _row(billing_db) == ({"seats": 5}, 3)
    worker.stop()


@pytest.mark.django_db
def test_a_postgres_kind_with_a_credential_or_bad_settings_is_refused(api: Any, admin: Any) -> None:
    url_as_value = {**SETTINGS, "credentials_env": f"postgres://u:{PASSWORD}@db/x"}
    refused = _put_kind(api, admin, target_settings=url_as_value)
    body = problem(refused, 422, "validation_error")
    assert PASSWORD not in refused.content.decode()
    assert any(e["field"] == "target_settings" for e in body["errors"])
    unknown = _put_kind(api, admin, target_settings={**SETTINGS, "password": PASSWORD})
    problem(unknown, 422, "validation_error")
    assert PASSWORD not in unknown.content.decode()
    bad_table = _put_kind(api, admin, target_settings={**SETTINGS, "table": "accounts; drop"})
    problem(bad_table, 422, "validation_error")
    assert not AuditEvent.objects.filter(event_type__startswith="resource_kind.").exists()


@pytest.mark.django_db
def test_an_unreadable_target_is_a_502_problem_not_a_500(
    api: Any, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, f"postgres://postgres:{PASSWORD}@127.0.0.1:1/nowhere")
    assert _put_kind(api, admin).status_code in (200, 201)
    run = _run()
    response = api.get(f"/api/v1/resources/{KIND}/acme", token=run.token)
    problem(response, 502, "target_unavailable")
    assert PASSWORD not in response.content.decode()
