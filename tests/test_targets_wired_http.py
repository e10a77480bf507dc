"""An http kind on a real third-party WebDAV server (WsgiDAV, HTTP Basic authentication),
governed end to end (issue 39): the kind API (its validators probed), reads through the target,
the agent's conditional write executed by a real worker, undo, the credential in no answer,
audit detail, worker log or log record; and a three-step plan across this server and a
PostgreSQL table that fails at step 3 and compensates steps 2 and 1."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from approvals.models import Action, Operation, PlanStep
from audit.models import AuditEvent
from ownership.models import ResourceKind
from tests.fixtures import plans as plan_fx
from tests.fixtures.api import make_active_run, make_agent_with_token
from tests.fixtures.dav import ENV, PASSWORD, WSGIDAV, Dav, running, wsgidav_server
from tests.fixtures.engine import wait_for
from tests.fixtures.targets import ROWS_SETTINGS, row, rows_database

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

KIND = "shared-file"
ROWS = "billing-account"
ROWS_ENV = "AIRLOCK_TEST_HTTP_PLAN_ROWS_DB"


@pytest.fixture
def dav(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Dav]:
    if not WSGIDAV.exists():
        pytest.skip("wsgidav is in the dev extra")
    server = wsgidav_server(tmp_path)
    (server.root / "acme").write_text(json.dumps({"seats": 5}))
    (server.root / "globex").write_text(json.dumps({"seats": 3}))
    time.sleep(1.05)  # whole-second mtimes in WsgiDAV's tags: our writes must move them
    yield from running(server, monkeypatch)


def _put_kind(api: Any, admin: Any, dav: Dav) -> Any:
    return api.put(
        f"/api/v1/resource-kinds/{KIND}",
        token=admin.token,
        body={
            "classes": {
                "create": "add_unique",
                "update": "recompute_field",
                "delete": "recompute_field",
            },
            "owner_group": "platform",
            "target": "http",
            "target_url": dav.url,
            "target_settings": {
                "credentials_env": ENV,
                "auth_scheme": "Basic",
                "honours_idempotency_key": False,
                "honours_fencing_token": False,
            },
            "probe_resource": "acme",
        },
    )


def _document(dav: Dav, name: str) -> Any:
    return json.loads((dav.root / name).read_text())


def _status(action_id: Any) -> str:
    return str(Action.objects.values_list("status", flat=True).get(pk=action_id))


def test_an_http_kind_on_webdav_is_governed_end_to_end_and_its_credential_shows_nowhere(
    api: Any, admin: Any, dav: Dav, rq_worker: Any, caplog: Any
) -> None:
    caplog.set_level("DEBUG")
    answers: list[bytes] = []
    kind = _put_kind(api, admin, dav)
    answers.append(kind.content)
    assert kind.status_code in (200, 201), kind.content
    assert kind.json()["capabilities"] == {"holds_fence": False, "takes_idempotency_key": False}

    agent = make_agent_with_token(f"files-bot-{uuid.uuid4().hex[:6]}")
    run = make_active_run(agent.agent, [{"resource": f"{KIND}/acme", "operations": ["update"]}])
    path = f"/api/v1/resources/{KIND}/acme"
    read = api.get(path, token=run.token)
    answers.append(read.content)
    assert read.status_code == 200 and read.json()["document"] == {"seats": 5}
    etag = read["ETag"]

    write = api.patch(
        path,
        token=run.token,
        body={"seats": 12},
        headers={"If-Match": etag, "Idempotency-Key": "dav-write-0001"},
        content_type="application/merge-patch+json",
    )
    answers.append(write.content)
    assert write.status_code == 202, write.content
    action_id = write.json()["id"]
    worker = rq_worker(**{ENV: os.environ[ENV]})
    wait_for(lambda: _status(action_id) in ("applied", "conflict", "failed"), timeout=30)
    assert _status(action_id) == "applied", worker.output()
    assert _document(dav, "acme") == {"seats": 12}
    done = Operation.objects.get(action_id=action_id, status="done")
    assert done.base_version == etag.strip('"') and done.result_version != done.base_version
    answers.append(api.get(f"/api/v1/actions/{action_id}", token=run.token).content)

    time.sleep(1.05)  # the undo's write must move the tag too
    undo = api.undo(action_id, token=run.token, key="dav-undo-0001")
    answers.append(undo.content)
    assert undo.status_code == 202, undo.content
    wait_for(lambda: _status(action_id) == "undone", timeout=30)
    assert _document(dav, "acme") == {"seats": 5}

    worker.stop()
    events = list(AuditEvent.objects.values_list("details", flat=True))
    places = [*(a.decode() for a in answers), json.dumps(events), worker.output()]
    places += [record.getMessage() for record in caplog.records]
    for place in places:
        assert PASSWORD not in place
        assert os.environ[ENV] not in place


def test_a_plan_across_webdav_and_postgres_that_fails_at_step_3_compensates_2_then_1(
    api: Any, admin: Any, dav: Dav, rq_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _put_kind(api, admin, dav).status_code in (200, 201)
    with rows_database("http_plans", {"acme": {"seats": 5}}) as rows_url:
        monkeypatch.setenv(ROWS_ENV, rows_url)
        ResourceKind.objects.update_or_create(
            slug=ROWS,
            defaults={
                "class_create_id": "add_unique",
                "class_update_id": "recompute_field",
                "class_delete_id": "recompute_field",
                "owner_group": "platform",
                "target": "postgres",
                "target_settings": {**ROWS_SETTINGS, "credentials_env": ROWS_ENV},
            },
        )
        agent = make_agent_with_token(f"plan-bot-{uuid.uuid4().hex[:6]}")
        run = make_active_run(
            agent.agent,
            [
                {"resource": f"{KIND}/acme", "operations": ["update"]},
                {"resource": f"{ROWS}/acme", "operations": ["update"]},
                {"resource": f"{KIND}/globex", "operations": ["update"]},
            ],
        )
        tags = {
            name: api.get(f"/api/v1/resources/{KIND}/{name}", token=run.token)["ETag"]
            for name in ("acme", "globex")
        }
        steps = [
            plan_fx.patch_step(f"{KIND}/acme", tags["acme"], {"seats": 10}),
            plan_fx.patch_step(f"{ROWS}/acme", '"1"', {"seats": 9}),
            plan_fx.patch_step(f"{KIND}/globex", tags["globex"], {"seats": 30}),
        ]
        plan_id = plan_fx.proposed_plan(api, run, steps)
        # Someone else rewrites step 3's file after the proposal: its If-Match is refused.
        (dav.root / "globex").write_text(json.dumps({"seats": 300}))
        worker = rq_worker(**{ENV: os.environ[ENV], ROWS_ENV: rows_url})
        final = ("applied", "compensated", "partially_compensated")
        wait_for(lambda: plan_fx.plan_status(plan_id) in final, timeout=60)
        assert plan_fx.plan_status(plan_id) == "compensated", worker.output()

        assert _document(dav, "acme") == {"seats": 5}
        assert row(rows_url, "acme") == ({"seats": 5}, 3)  # written, then compensated
        assert _document(dav, "globex") == {"seats": 300}  # someone's change stands
        steps_done = list(PlanStep.objects.filter(plan_id=plan_id).order_by("position"))
        assert [s.compensation_status for s in steps_done[:2]] == ["compensated"] * 2
        assert steps_done[2].status == "refused"
        undone = [
            AuditEvent.objects.get(event_type="write.undone", action_id=s.action_id).pk
            for s in steps_done[:2]
        ]
        assert undone[1] < undone[0]  # step 2 compensated before step 1
