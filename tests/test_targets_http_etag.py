"""The HTTP/ETag adapter (engine/targets/http_etag.py) against real third-party WebDAV
servers no one here wrote, each in its own process on a loopback port with HTTP Basic
authentication on, serving a temporary folder:

- WsgiDAV (PyPI, the dev extra). It sends quoted (strong-form) ETags and honours If-Match and
  If-None-Match: * with 412 — but its tag is inode-mtime-size with the mtime in whole
  seconds, so a same-size write within one second keeps the tag (`test_finding_...`).
- Apache httpd's mod_dav (Debian's `apache2`; skipped where it is not installed or we are
  not root). Its tag is size-mtime in microseconds, and it marks a file changed within the
  last second with a WEAK tag: the adapter refuses those and reads back until the tag is
  strong (`readback_seconds`).

Every test that needs the tag to have moved lets a full second pass after the seed, and
says so. A timeout after sending is produced for real: the server's process group is stopped
(SIGSTOP) so the kernel accepts the connection and the request and no answer comes; it is
then continued (the write lands: applied once) or killed and restarted (it never lands).
"""

from __future__ import annotations

import base64
import logging
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.targets.base import (
    ABSENT,
    Applied,
    Conflict,
    NotApplied,
    Outcome,
    TargetConfigError,
    WeakValidator,
    settle_by_reading,
    strong_version,
)
from engine.targets.http_etag import VERSION_DID_NOT_MOVE, HttpEtagSettings, HttpEtagTarget
from tests.fixtures.dav import ENV, PASSWORD, USER, Dav, free_port


def _target(dav: Dav, **extra: Any) -> HttpEtagTarget:
    settings = {"base_url": dav.url, "credentials_env": ENV, "auth_scheme": "Basic", **extra}
    return HttpEtagTarget(HttpEtagSettings.from_settings(settings))


def _key() -> str:
    return f"airlock-action-{uuid.uuid4()}"


def _seed(target: HttpEtagTarget, name: str, document: Any) -> str:
    created = target.create(name, document, fence=1, idempotency_key=_key())
    assert created.outcome is Outcome.APPLIED, created
    assert created.version is not None
    # A full second, so the next write moves the tag on both servers (WsgiDAV: a new mtime
    # second; Apache: the file is no longer "just changed").
    time.sleep(1.05)
    return created.version


def test_wsgidav_sends_strong_tags_and_honours_the_preconditions(wsgidav: Dav) -> None:
    auth = (USER, PASSWORD)
    with httpx.Client(base_url=wsgidav.url, auth=auth) as client:
        assert (
            client.put("/a.json", content=b"{}", headers={"If-None-Match": "*"}).status_code == 201
        )
        again = client.put("/a.json", content=b"{}", headers={"If-None-Match": "*"})
        assert again.status_code == 412
        tag = client.get("/a.json").headers["etag"]
        assert tag.startswith('"') and not tag.startswith("W/")
        wrong = client.put("/a.json", content=b"[]", headers={"If-Match": '"nope"'})
        assert wrong.status_code == 412
        assert client.put("/a.json", content=b"[1]", headers={"If-Match": tag}).status_code == 204
        assert client.get("/a.json", auth=None).status_code == 401


def test_apache_tags_a_just_changed_file_weak_and_the_adapter_waits_or_refuses(
    apache: Dav,
) -> None:
    """Apache honours the preconditions too, sends no tag with a PUT's answer, and tags a
    file changed within the last second as weak — which no precondition may rest on."""
    auth = (USER, PASSWORD)
    with httpx.Client(base_url=apache.url, auth=auth) as client:
        created = client.put("/a.json", content=b"{}", headers={"If-None-Match": "*"})
        assert created.status_code == 201 and "etag" not in created.headers
        weak = client.get("/a.json").headers["etag"]
        assert weak.startswith('W/"')
        # A weak tag never matches an If-Match (strong comparison): no blind write through it.
        assert client.put("/a.json", content=b"[]", headers={"If-Match": weak}).status_code == 412
        assert (
            client.put("/a.json", content=b"{}", headers={"If-None-Match": "*"}).status_code == 412
        )
        assert client.get("/a.json", auth=None).status_code == 401
    impatient = _target(apache, readback_seconds=0)
    with pytest.raises(WeakValidator, match="weak"):
        impatient.read("a.json")
    made = impatient.create("b.json", {"b": 1}, fence=1, idempotency_key=_key())
    assert made.applied and made.version is None and "weak" in made.detail
    patient = _target(apache)  # reads back until the tag turns strong (about a second)
    made = patient.create("c.json", {"c": 1}, fence=1, idempotency_key=_key())
    assert made.applied and made.version is not None and made.detail == ""
    assert patient.read("c.json").version == made.version


def test_finding_wsgidav_tag_can_stay_put_across_a_same_size_write(wsgidav: Dav) -> None:
    """Not a guarantee we want — a limit of this server, pinned so it is seen: a write of
    the same size within the same second leaves the tag as it was. A writer holding the old
    tag would then overwrite it. The adapter marks its own such write; it cannot see others'."""
    target = _target(wsgidav)
    time.sleep(1.02 - (time.time() % 1.0))
    v1 = target.create("same.json", {"n": 1}, fence=1, idempotency_key=_key()).version
    assert v1 is not None
    second = target.write(
        "same.json", {"n": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    assert second.applied and second.version == v1 and second.detail == VERSION_DID_NOT_MOVE


def test_two_writers_from_the_same_version_one_applies_the_other_is_stale(dav: Dav) -> None:
    target = _target(dav)
    v1 = _seed(target, "acme.json", {"limit": 1})
    first = target.write(
        "acme.json", {"limit": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    second = target.write(
        "acme.json", {"limit": 3}, expected_version=v1, fence=3, idempotency_key=_key()
    )
    assert first.outcome is Outcome.APPLIED and first.version not in (None, v1)
    assert first.detail == ""
    assert second.outcome is Outcome.STALE and second.current is not None
    assert (second.current.document, second.current.version) == ({"limit": 2}, first.version)
    assert target.read("acme.json").document == {"limit": 2}
    assert not target.capabilities.holds_fence and not target.capabilities.takes_idempotency_key


def test_create_if_absent_twice_the_second_sees_the_first(dav: Dav) -> None:
    target = _target(dav)
    first = target.create("new.json", {"by": 1}, fence=1, idempotency_key=_key())
    second = target.create("new.json", {"by": 2}, fence=1, idempotency_key=_key())
    assert first.applied
    assert second.outcome is Outcome.STALE and second.current is not None
    assert second.current.document == {"by": 1}


def test_delete_is_conditional_on_the_tag(dav: Dav) -> None:
    target = _target(dav)
    v1 = _seed(target, "gone.json", {"a": 1})
    v2 = target.write(
        "gone.json", {"a": 22}, expected_version=v1, fence=2, idempotency_key=_key()
    ).version
    assert v2 is not None and v2 != v1
    stale = target.delete("gone.json", expected_version=v1, fence=3, idempotency_key=_key())
    assert stale.outcome is Outcome.STALE and stale.current is not None
    assert stale.current.document == {"a": 22}
    assert target.delete("gone.json", expected_version=v2, fence=3, idempotency_key=_key()).applied
    assert target.read("gone.json") == ABSENT
    assert (dav.root / "gone.json").exists() is False


def _write_into_a_stopped_server(dav: Dav, target: HttpEtagTarget, v1: str) -> Any:
    dav.pause()
    return target.write("k.json", {"x": 22}, expected_version=v1, fence=2, idempotency_key=_key())


def test_a_timeout_after_sending_is_unknown_and_settles_as_applied_once(dav: Dav) -> None:
    target = _target(dav, timeout=1)
    v1 = _seed(target, "k.json", {"x": 1})
    result = _write_into_a_stopped_server(dav, target, v1)
    assert result.outcome is Outcome.UNKNOWN
    dav.resume()  # the request it accepted is served now
    deadline = time.monotonic() + 10
    while (dav.root / "k.json").read_bytes() != b'{"x":22}' and time.monotonic() < deadline:
        time.sleep(0.05)
    settled = _settle(target, "k.json", written_document={"x": 22}, observed_version=v1)
    assert isinstance(settled, Applied) and settled.version not in (None, v1)


def _settle(target: HttpEtagTarget, name: str, **how: Any) -> Any:
    """settle_by_reading as the caller will: a read that meets a weak tag (Apache, within a
    second of the change) raises and settles nothing — ask again a little later."""
    for _ in range(20):
        try:
            return settle_by_reading(target, name, **how)
        except WeakValidator:
            time.sleep(0.2)
    raise AssertionError("the tag never turned strong")


def test_a_timeout_after_sending_that_never_landed_settles_as_not_applied(dav: Dav) -> None:
    target = _target(dav, timeout=1)
    v1 = _seed(target, "k.json", {"x": 1})
    assert _write_into_a_stopped_server(dav, target, v1).outcome is Outcome.UNKNOWN
    dav.stop()  # killed while stopped: the accepted request is never served
    dav.start()
    settled = settle_by_reading(target, "k.json", written_document={"x": 22}, observed_version=v1)
    assert isinstance(settled, NotApplied) and settled.current.document == {"x": 1}
    # Someone else's change since then is a conflict, not ours.
    target.write("k.json", {"x": 333}, expected_version=v1, fence=3, idempotency_key=_key())
    settled = settle_by_reading(target, "k.json", written_document={"x": 22}, observed_version=v1)
    assert isinstance(settled, Conflict) and settled.current.document == {"x": 333}


def test_a_server_that_is_down_is_not_sent(dav: Dav) -> None:
    target = _target(dav)
    dav.stop()
    result = target.write("a.json", {"a": 1}, expected_version="x", fence=1, idempotency_key=_key())
    assert result.outcome is Outcome.NOT_SENT


def test_headers_of_ours_go_only_to_a_target_that_honours_them() -> None:
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            seen.append({k.lower(): v for k, v in self.headers.items()})
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(204)
            self.send_header("ETag", '"v2"')
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for honours in (False, True):
            target = HttpEtagTarget(
                HttpEtagSettings.from_settings(
                    {
                        "base_url": url,
                        "honours_idempotency_key": honours,
                        "honours_fencing_token": honours,
                    }
                )
            )
            assert (
                target.write(
                    "a.json", {}, expected_version="v1", fence=7, idempotency_key="k-1"
                ).version
                == "v2"
            )
    finally:
        server.shutdown()
    assert "idempotency-key" not in seen[0] and "fencing-token" not in seen[0]
    assert seen[1]["idempotency-key"] == "k-1" and seen[1]["fencing-token"] == "7"
    assert seen[1]["if-match"] == '"v1"'


def test_missing_and_weak_validators_are_refused(tmp_path: Path) -> None:
    """Python's own file server sends no ETag at all: the target cannot be governed."""
    (tmp_path / "a.json").write_text("{}")
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "http.server",
            str(port),
            "--bind",
            "127.0.0.1",
            "--directory",
            str(tmp_path),
        ],
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
        target = HttpEtagTarget(
            HttpEtagSettings.from_settings({"base_url": f"http://127.0.0.1:{port}"})
        )
        with pytest.raises(WeakValidator, match="no ETag"):
            target.read("a.json")
        with pytest.raises(WeakValidator):
            settle_by_reading(target, "a.json", written_document={}, observed_version="1")
    finally:
        process.kill()
        process.wait(10)
    for tag in ('W/"1"', None, "", "1", '"a"b"', '""'):
        with pytest.raises(WeakValidator):
            strong_version(tag)
    assert strong_version('"2147760-1796529342-8"') == "2147760-1796529342-8"


def test_a_credential_never_appears_in_errors_or_logs(
    dav: Dav, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret_forms = [PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()]
    texts: list[str] = []
    target = _target(dav)
    created = target.create("c.json", {"a": 1}, fence=1, idempotency_key=_key())
    assert created.applied  # the right credential reached the server
    texts += [repr(created), repr(target.settings), repr(target.read("c.json"))]
    monkeypatch.setenv(ENV, f"{USER}:wrong-{PASSWORD}")
    refused = target.write(
        "c.json", {"a": 2}, expected_version=str(created.version), fence=2, idempotency_key=_key()
    )
    assert refused.outcome is Outcome.FAILED and "401" in refused.detail
    texts.append(repr(refused))
    bearer = _target(dav, auth_scheme="Bearer")
    monkeypatch.setenv(ENV, f"{PASSWORD}\nX-Injected: 1")  # an illegal header value
    broken = bearer.write("c.json", {"a": 2}, expected_version="x", fence=2, idempotency_key=_key())
    assert broken.outcome is Outcome.NOT_SENT, broken
    texts.append(repr(broken))
    dav.stop()
    monkeypatch.setenv(ENV, f"{USER}:{PASSWORD}")
    down = target.write("c.json", {"a": 2}, expected_version="x", fence=2, idempotency_key=_key())
    assert down.outcome is Outcome.NOT_SENT
    texts += [repr(down), caplog.text]
    for text in texts:
        for form in secret_forms:
            assert form not in text, text


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"base_url": "http://u:p@host/x"}, "no user or password"),
        ({"base_url": "ftp://host/x"}, "http"),
        ({"base_url": "http://host/x?token=1"}, "query"),
        ({"base_url": "http://host", "credentials_env": "Bearer abc"}, "credentials_env"),
        ({"base_url": "http://host", "auth_scheme": "Digest"}, "auth_scheme"),
        ({"base_url": "http://host", "honours_fencing_token": "yes"}, "honours_fencing_token"),
        ({"base_url": "http://host", "token": "t"}, "unknown setting"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(TargetConfigError, match=message):
        HttpEtagSettings.from_settings(settings)


def test_todays_http_dialect_is_this_adapter_with_both_headers_honoured() -> None:
    """tests/targetserver.py speaks today's `http` kind (integer tags, our Idempotency-Key
    and Fencing-Token): the adapter with both flags on governs it, fence and replay included."""
    from tests.targetserver import TargetServer  # reason: the project's own test target

    server = TargetServer().start()
    try:
        target = HttpEtagTarget(
            HttpEtagSettings.from_settings(
                {
                    "base_url": server.url,
                    "honours_idempotency_key": True,
                    "honours_fencing_token": True,
                    "timeout": 1,
                }
            )
        )
        assert target.capabilities.holds_fence and target.capabilities.takes_idempotency_key
        assert target.create("a", {"n": 1}, fence=5, idempotency_key="k1").version == "1"
        zombie = target.write("a", {"n": 9}, expected_version="1", fence=4, idempotency_key="k2")
        assert zombie.outcome is Outcome.FENCED and zombie.current is not None
        server.fail_next(503)
        busy = target.write("a", {"n": 2}, expected_version="1", fence=6, idempotency_key="k3")
        assert busy.outcome is Outcome.LOCKED and busy.retry_after == 0
        server.hang_after_apply(2)
        lost = target.write("a", {"n": 2}, expected_version="1", fence=6, idempotency_key="k3")
        assert lost.outcome is Outcome.UNKNOWN
        # With a key the target honours, replaying it settles the unknown write: no new effect.
        effects = server.effects
        replay = target.write("a", {"n": 2}, expected_version="1", fence=6, idempotency_key="k3")
        assert replay.applied and replay.version == "2" and server.effects == effects
        stale = target.write("a", {"n": 3}, expected_version="1", fence=7, idempotency_key="k4")
        assert stale.outcome is Outcome.STALE and stale.current is not None
        assert stale.current.document == {"n": 2}
    finally:
        server.stop()
