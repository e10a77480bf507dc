"""A kind whose target hands out weak or no validators cannot be governed (issue 39 §1):
`PUT /resource-kinds/{kind}` with `probe_resource` reads one document and refuses the kind
(422, nothing stored, nothing audited); a target that starts handing out weak tags later is
met at the next read or proposal with a 502 `weak_validator` — no action is recorded, so no
write can rest on such a tag.

Targets: Python's own `http.server` (no ETag at all: a server no one here wrote) and a small
HTTP server in this process whose tag turns weak on demand (RFC 9110's `W/"…"`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from approvals.models import Action
from audit.models import AuditEvent
from ownership.models import ResourceKind
from tests.fixtures.api import make_active_run, make_agent_with_token, problem

pytestmark = pytest.mark.django_db

KIND = "shared-file"


def _put_kind(api: Any, admin: Any, url: str, probe: str | None) -> Any:
    body: dict[str, Any] = {
        "classes": {
            "create": "add_unique",
            "update": "recompute_field",
            "delete": "recompute_field",
        },
        "owner_group": "platform",
        "target": "http",
        "target_url": url,
        "target_settings": {"honours_idempotency_key": False, "honours_fencing_token": False},
    }
    if probe is not None:
        body["probe_resource"] = probe
    return api.put(f"/api/v1/resource-kinds/{KIND}", token=admin.token, body=body)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def no_etag_server(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "a.json").write_text("{}")
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(10)


class _Tagged(BaseHTTPRequestHandler):
    etag = '"v1"'

    def do_GET(self) -> None:
        body = b'{"seats": 5}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("ETag", type(self).etag)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def tagged_server() -> Iterator[tuple[str, type[_Tagged]]]:
    handler = type("Handler", (_Tagged,), {"etag": '"v1"'})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_kind_on_a_target_with_no_etag_is_refused(
    api: Any, admin: Any, no_etag_server: str
) -> None:
    refused = _put_kind(api, admin, no_etag_server, "a.json")
    body = problem(refused, 422, "validation_error")
    [error] = [e for e in body["errors"] if e["field"] == "probe_resource"]
    assert error["message"].startswith("refused:") and "ETag" in error["message"]
    assert not ResourceKind.objects.filter(slug=KIND).exists()
    assert not AuditEvent.objects.filter(event_type__startswith="resource_kind.").exists()


def test_a_kind_on_a_target_with_weak_tags_is_refused_and_one_that_turns_weak_is_met_with_502(
    api: Any, admin: Any, tagged_server: tuple[str, type[_Tagged]]
) -> None:
    url, handler = tagged_server
    handler.etag = 'W/"v1"'
    refused = _put_kind(api, admin, url, "a.json")
    body = problem(refused, 422, "validation_error")
    assert any(e["field"] == "probe_resource" for e in body["errors"])
    assert not ResourceKind.objects.filter(slug=KIND).exists()

    handler.etag = '"v1"'  # strong: the kind is accepted
    accepted = _put_kind(api, admin, url, "a.json")
    assert accepted.status_code in (200, 201), accepted.content

    agent = make_agent_with_token(f"files-bot-{uuid.uuid4().hex[:6]}")
    run = make_active_run(agent.agent, [{"resource": f"{KIND}/a.json", "operations": ["update"]}])
    path = f"/api/v1/resources/{KIND}/a.json"
    assert api.get(path, token=run.token)["ETag"] == '"v1"'

    handler.etag = 'W/"v2"'  # the target changed and now hands out a weak tag
    problem(api.get(path, token=run.token), 502, "weak_validator")
    write = api.put(
        path,
        token=run.token,
        body={"seats": 9},
        headers={"If-Match": '"v2"', "Idempotency-Key": "files-weak-0001"},
    )
    problem(write, 502, "weak_validator")
    assert not Action.objects.filter(kind_id=KIND).exists()  # nothing to execute blindly
