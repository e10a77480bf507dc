"""`manage.py audit_anchor` prints the verified head {seq, hash, time}, appends it to a file,
POSTs it to a URL; `manage.py audit_verify --anchor FILE` proves the chain still holds every
anchored head — the one check that catches a history rewritten together with its head row."""

from __future__ import annotations

import io
import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from audit.chain import HASHED_COLUMNS, event_hash, hashed_fields
from audit.linker import audit_link
from audit.models import AuditEvent
from audit.services import Actor, audit_append, audit_chain_verify
from audit.verify import audit_head
from tests.fixtures.audit import forget_verification

pytestmark = pytest.mark.django_db
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00$")


@pytest.fixture(autouse=True)
def _no_checkpoint() -> Iterator[None]:
    forget_verification()
    yield
    forget_verification()


def _append(count: int) -> None:
    """`count` events, appended and linked (audit/linker.py)."""
    for n in range(count):
        audit_append(event_type="test.event", actor=Actor.system("tests"), details={"n": n})
    audit_link()


def _anchor(**options: Any) -> dict[str, Any]:
    out = io.StringIO()
    call_command("audit_anchor", stdout=out, **options)
    printed: dict[str, Any] = json.loads(out.getvalue())
    return printed


def _verify(*anchors: str) -> str:
    out = io.StringIO()
    call_command("audit_verify", *[f"--anchor={path}" for path in anchors], stdout=out)
    return out.getvalue()


def _sql(statement: str, params: list[Any]) -> None:
    # The test connection has airlock.audit_maintenance on (conftest): tampering is possible.
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def _rewrite_from(seq: int, details: dict[str, Any]) -> None:
    """What a forger with the database does: edit event `seq`, re-hash it and every event
    after it, move the head row — the chain then walks whole."""
    prev = AuditEvent.objects.get(seq=seq).prev_hash
    for row in AuditEvent.objects.filter(seq__gte=seq).order_by("seq"):
        if row.seq == seq:
            row.details = details
        digest = event_hash(hashed_fields(**{n: getattr(row, n) for n in HASHED_COLUMNS}), prev)
        _sql(
            "UPDATE audit_auditevent SET details = %s::jsonb, prev_hash = %s, hash = %s "
            "WHERE seq = %s",
            [json.dumps(row.details), prev, digest, row.seq],
        )
        prev = digest
    _sql("UPDATE audit_audithead SET hash = %s WHERE id = 1", [prev])
    forget_verification()


def test_the_anchor_is_the_verified_head_and_appends_one_line_a_run(tmp_path: Path) -> None:
    anchors = tmp_path / "anchors.jsonl"
    _append(3)
    first = _anchor(append=str(anchors))
    assert (first["seq"], first["hash"]) == audit_head() == (3, first["hash"])
    assert TIME.match(first["time"]) and set(first) == {"seq", "hash", "time"}
    _append(2)
    second = _anchor(append=str(anchors))
    assert second["seq"] == 5
    lines = [json.loads(line) for line in anchors.read_text().splitlines()]
    assert lines == [first, second]
    assert "anchors: every one of 2 is in the chain" in _verify(str(anchors))


class _Notary(BaseHTTPRequestHandler):
    received: list[Any] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.headers["Content-Type"], json.loads(body)))
        self.send_response(201 if self.path == "/anchors" else 500)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def notary() -> Iterator[str]:
    _Notary.received = []
    server = HTTPServer(("127.0.0.1", 0), _Notary)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_anchor_is_posted_as_json(notary: str) -> None:
    _append(2)
    anchor = _anchor(post=f"{notary}/anchors")
    assert _Notary.received == [("application/json", anchor)]


def test_a_post_that_fails_exits_1_after_printing_and_appending(
    notary: str, tmp_path: Path
) -> None:
    _append(1)
    anchors, out = tmp_path / "anchors.jsonl", io.StringIO()
    with pytest.raises(CommandError, match="answered 500") as refused:
        call_command("audit_anchor", append=str(anchors), post=f"{notary}/x", stdout=out)
    assert refused.value.returncode == 1
    assert json.loads(out.getvalue()) == json.loads(anchors.read_text())


def test_a_post_to_a_silent_url_gives_up_at_its_timeout(tmp_path: Path) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        with pytest.raises(CommandError, match=r"POST .* failed") as refused:
            call_command("audit_anchor", post=url, timeout=0.5, stdout=io.StringIO())
    assert refused.value.returncode == 1


def test_a_broken_chain_is_not_anchored(tmp_path: Path) -> None:
    _append(4)
    _sql("UPDATE audit_auditevent SET details = '{\"forged\": true}' WHERE seq = %s", [2])
    with pytest.raises(CommandError, match="refusing to anchor a broken chain: first bad seq 2"):
        call_command("audit_anchor", append=str(tmp_path / "a.jsonl"), stdout=io.StringIO())
    assert not (tmp_path / "a.jsonl").exists()


def test_a_history_rewritten_with_its_head_walks_whole_but_fails_its_anchor(
    tmp_path: Path,
) -> None:
    anchors = tmp_path / "anchors.jsonl"
    _append(3)
    _anchor(append=str(anchors))
    _append(4)
    _anchor(append=str(anchors))
    anchored_7 = audit_head()[1]
    _rewrite_from(5, {"forged": True})
    assert audit_chain_verify().ok  # the chain alone cannot tell
    with pytest.raises(CommandError) as refused:
        _verify(str(anchors))
    assert refused.value.returncode == 1
    assert str(refused.value).startswith(f"anchor #7 {anchored_7} of ")
    assert f"({anchors} line 2)" in str(refused.value)
    assert "event #7 now has hash" in str(refused.value)


def test_a_truncated_chain_fails_the_anchor_of_its_lost_head(tmp_path: Path) -> None:
    anchors = tmp_path / "anchors.jsonl"
    _append(2)
    _anchor(append=str(anchors))
    _append(3)
    _anchor(append=str(anchors))
    # The last three events deleted and the head row moved back: the rest walks whole.
    _sql("DELETE FROM audit_auditevent WHERE seq > %s", [2])
    _sql(
        "UPDATE audit_audithead SET seq = 2, hash = (SELECT hash FROM audit_auditevent "
        "WHERE seq = 2) WHERE id = 1",
        [],
    )
    forget_verification()
    with pytest.raises(CommandError, match=r"anchor #5 .*line 2.*the chain has no event #5"):
        _verify(str(anchors))


def test_an_anchor_file_that_is_not_anchors_is_refused_before_walking(tmp_path: Path) -> None:
    bad = tmp_path / "anchors.jsonl"
    bad.write_text('{"seq": 1, "hash": "abc"}\nnot json\n')
    with pytest.raises(CommandError, match="line 2: not an anchor") as refused:
        _verify(str(bad))
    assert refused.value.returncode == 2


def test_the_older_bare_hash_anchor_still_works() -> None:
    _append(2)
    head_hash = audit_head()[1]
    assert "audit chain ok" in _verify(head_hash)
    with pytest.raises(CommandError, match="no longer in the chain"):
        _verify("0" * 63 + "1")
