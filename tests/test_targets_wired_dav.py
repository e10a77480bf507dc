"""A kind whose documents are files on a real third-party WebDAV server (WsgiDAV and Apache
httpd's mod_dav, tests/fixtures/dav.py), governed end to end through the API and a real
worker (issue 39): the server's own opaque ETag is the version the agent reads and sends
back; two writes from the same version: the second is refused while the first is in flight;
a write from a version someone else has since replaced meets the server's `If-Match` and is a
conflict (nothing lost); undo after someone else changed the file is refused by the
server's precondition, never an overwrite; the Basic credential the worker
reads from its environment appears in no answer, audit detail, log line or worker output.
Neither server takes our fencing token or idempotency key: the kind says so."""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from typing import Any

import httpx
import pytest

from approvals.models import Action, Operation
from audit.models import AuditEvent
from tests.fixtures.api import make_active_run, make_agent_with_token
from tests.fixtures.dav import ENV, PASSWORD, USER, Dav
from tests.fixtures.engine import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

KIND = "dav-policy"
PATH = f"/api/v1/resources/{KIND}/acme.json"


def _put_kind(api: Any, admin: Any, dav: Dav) -> Any:
    body = {
        "classes": {
            "create": "add_unique",
            "update": "recompute_field",
            "delete": "recompute_field",
        },
        "owner_group": "platform",
        "target": "http",
        "target_url": dav.url,
        "target_settings": {"credentials_env": ENV, "auth_scheme": "Basic"},
    }
    return api.put(f"/api/v1/resource-kinds/{KIND}", token=admin.token, body=body)


def _run() -> Any:
    agent = make_agent_with_token(f"dav-bot-{uuid.uuid4().hex[:6]}")
    return make_active_run(
        agent.agent, [{"resource": f"{KIND}/acme.json", "operations": ["update"]}]
    )


def _server_put(dav: Dav, document: Any) -> None:
    """Someone else writes the file on the server, outside Airlock."""
    with httpx.Client(base_url=dav.url, auth=(USER, PASSWORD)) as client:
        answer = client.put("/acme.json", content=json.dumps(document))
    assert answer.status_code in (201, 204), answer.status_code
    # A full second, so the next write moves the tag on both servers (WsgiDAV: a new mtime
    # second; Apache: the file is no longer "just changed", its tag strong again).
    time.sleep(1.05)


def _server_file(dav: Dav) -> Any:
    return json.loads((dav.root / "acme.json").read_text())


def _propose(api: Any, run: Any, etag: str, document: Any, key: str) -> str:
    answer = api.put(
        PATH,
        token=run.token,
        body=document,
        headers={"If-Match": etag, "Idempotency-Key": key},
    )
    assert answer.status_code == 202, answer.content
    action_id: str = answer.json()["id"]
    return action_id


def _settled(action_id: str) -> bool:
    return Action.objects.get(pk=action_id).status in ("applied", "conflict", "failed")


def test_two_writes_from_the_same_server_version_one_applies_the_other_conflicts(
    api: Any, admin: Any, operator: Any, dav: Dav, rq_worker: Any, caplog: Any
) -> None:
    caplog.set_level("DEBUG")
    _server_put(dav, {"limit": 1})
    kind = _put_kind(api, admin, dav)
    assert kind.status_code in (200, 201), kind.content
    assert kind.json()["capabilities"] == {"holds_fence": False, "takes_idempotency_key": False}
    answers: list[bytes] = [kind.content]

    # Two of the agent's tool calls read the same version (one run: write authority over a
    # resource is one run's at a time) and both write from it: the second is refused while
    # the first is in flight, naming it.
    run = _run()
    read_first, read_second = api.get(PATH, token=run.token), api.get(PATH, token=run.token)
    answers += [read_first.content, read_second.content]
    assert read_first.status_code == read_second.status_code == 200
    etag = read_first["ETag"]
    assert read_second["ETag"] == etag and etag.startswith('"')
    assert not etag.strip('"').isdigit()  # the server's own opaque tag, not a counter of ours
    assert read_first.json()["document"] == {"limit": 1}
    first = _propose(api, run, etag, {"limit": 2}, f"dav-a-{uuid.uuid4().hex}")
    second = api.put(
        PATH,
        token=run.token,
        body={"limit": 3},
        headers={"If-Match": etag, "Idempotency-Key": f"dav-b-{uuid.uuid4().hex}"},
    )
    answers.append(second.content)
    assert second.status_code == 412 and first in second.content.decode(), second.content
    worker = rq_worker(**{ENV: os.environ[ENV]})
    wait_for(lambda: _settled(first), timeout=40)
    assert Action.objects.get(pk=first).status == "applied"
    assert _server_file(dav) == {"limit": 2}
    done = Operation.objects.get(action_id=first, status="done")
    assert done.base_version == etag.strip('"') and done.result_version not in (None, "")
    assert done.result_version != done.base_version

    # The agent reads the new tag; someone else then changes the file on the server. The
    # agent's write from the tag it read reaches the server's If-Match and is refused there:
    # a conflict, the other change stands.
    time.sleep(1.05)  # Apache tags a just-changed file weak for a second
    fresh = api.get(PATH, token=run.token)
    assert fresh.json()["document"] == {"limit": 2} and fresh["ETag"] != etag
    _server_put(dav, {"limit": 5, "by": "someone"})
    stale = _propose(api, run, fresh["ETag"], {"limit": 4}, f"dav-c-{uuid.uuid4().hex}")
    wait_for(lambda: _settled(stale), timeout=40)
    assert Action.objects.get(pk=stale).status == "conflict"
    assert _server_file(dav) == {"limit": 5, "by": "someone"}

    # Undoing the first write now must not erase that change either.
    undo = api.undo(first, token=run.token, key="dav-undo-1")
    answers.append(undo.content)
    assert undo.status_code == 202, undo.content
    wait_for(lambda: Operation.objects.filter(undo_of=done, status="failed").exists(), timeout=40)
    assert _server_file(dav) == {"limit": 5, "by": "someone"}
    assert Action.objects.get(pk=first).status == "applied"  # not undone

    worker.stop()
    basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    events = json.dumps(list(AuditEvent.objects.values_list("details", flat=True)))
    places = [*(x.decode() for x in answers), events, worker.output()]
    places += [record.getMessage() for record in caplog.records]
    for place in places:
        assert PASSWORD not in place and basic not in place
