"""A tiny conditional-write HTTP service of our own, for the HTTP target adapter.

Documents live at /<name> with an integer strong ETag. Writes need If-Match
(or If-None-Match: * to create) and an Idempotency-Key; a repeated key replays
the stored response with `Idempotent-Replayed: true` and no new effect. A
`Fencing-Token` lower than the last accepted one is refused with 409.
`effects` counts the writes actually applied. Tests script failures:

    server.fail_next(429, 503)           # the next write requests get these statuses
    server.hang_after_apply(seconds=3)    # apply the next write, then answer too late
"""

from __future__ import annotations

import json
import threading
import time
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

# RFC 7396, as the product applies it (its own tests check it against the RFC's examples).
from ownership.diff import apply_merge_patch

# What a request gets: status, headers, body, and seconds to wait before answering.
Answer = tuple[int, dict[str, str], bytes, float]


def _json_answer(status: int, body: Any, headers: dict[str, str] | None = None) -> Answer:
    return (
        status,
        {**(headers or {}), "Content-Type": "application/json"},
        json.dumps(body).encode(),
        0.0,
    )


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, headers: dict[str, str], payload: bytes) -> None:
        try:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the caller gave up (a timed-out write)

    def do_GET(self) -> None:
        target = self.server.target
        with target.lock:
            entry = target.documents.get(unquote(self.path.lstrip("/")))
        if entry is None or entry["deleted"]:
            status, headers, payload, _ = _json_answer(404, {"error": "not found"})
        else:
            etag = {"ETag": f'"{entry["version"]}"'}
            status, headers, payload, _ = _json_answer(200, entry["document"], etag)
        self._send(status, headers, payload)

    def _write(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        target = self.server.target
        with target.lock:
            status, headers, payload, hang = target.write(
                self.command, unquote(self.path.lstrip("/")), self.headers, raw
            )
        if hang:
            time.sleep(hang)
        self._send(status, headers, payload)

    do_PUT = _write
    do_PATCH = _write
    do_DELETE = _write


class _HTTPServer(ThreadingHTTPServer):
    target: TargetServer


class TargetServer:
    def __init__(self) -> None:
        self.documents: dict[str, dict[str, Any]] = {}  # name -> {version, document, deleted}
        self.replies: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.last_fence: dict[str, int] = {}
        self.effects = 0
        self.requests: list[dict[str, Any]] = []
        self.scripted_failures: list[int] = []
        self.hang_seconds = 0.0
        self.lock = threading.Lock()
        self.httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.target = self
        self.httpd.daemon_threads = True
        # serve_forever's poll interval is how long stop() waits for it (0.5 s by default).
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def write(self, method: str, name: str, headers: Message, raw: bytes) -> Answer:
        """A PUT, PATCH or DELETE of `name` (called with the lock held)."""
        key = headers.get("Idempotency-Key", "")
        fence = int(headers.get("Fencing-Token") or 0)
        self.requests.append(
            {
                "method": method,
                "name": name,
                "key": key,
                "fence": fence,
                "if_match": headers.get("If-Match"),
            }
        )
        if self.scripted_failures:
            return _json_answer(
                self.scripted_failures.pop(0), {"error": "scripted"}, {"Retry-After": "0"}
            )
        if not key:
            return _json_answer(400, {"error": "Idempotency-Key required"})
        if key in self.replies:
            status, stored, body = self.replies[key]
            return status, {**stored, "Idempotent-Replayed": "true"}, body, 0.0
        if fence < self.last_fence.get(name, 0):
            return _json_answer(409, {"error": "stale fence"})
        entry = self.documents.get(name)
        refused = _precondition_refused(entry, headers)
        if refused is not None:
            return refused
        return self._apply(method, name, entry, json.loads(raw) if raw else None, key, fence)

    def _apply(
        self, method: str, name: str, entry: dict[str, Any] | None, body: Any, key: str, fence: int
    ) -> Answer:
        version = (entry["version"] if entry else 0) + 1
        if method == "DELETE":
            document, deleted = {}, True
        elif method == "PATCH":
            document, deleted = apply_merge_patch(entry["document"] if entry else {}, body), False
        else:
            document, deleted = body, False
        self.documents[name] = {"version": version, "document": document, "deleted": deleted}
        self.last_fence[name] = fence
        self.effects += 1
        headers = {"ETag": f'"{version}"', "Content-Type": "application/json"}
        payload = json.dumps(document).encode()
        self.replies[key] = (200, headers, payload)
        hang, self.hang_seconds = self.hang_seconds, 0.0
        return 200, headers, payload, hang

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> TargetServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def seed(self, name: str, document: dict[str, Any], version: int = 1) -> None:
        with self.lock:
            self.documents[name] = {"version": version, "document": document, "deleted": False}

    def fail_next(self, *statuses: int) -> None:
        with self.lock:
            self.scripted_failures.extend(statuses)

    def hang_after_apply(self, seconds: float) -> None:
        with self.lock:
            self.hang_seconds = seconds


def _precondition_refused(entry: dict[str, Any] | None, headers: Message) -> Answer | None:
    exists = entry is not None and not entry["deleted"]
    if headers.get("If-None-Match") == "*":
        return _json_answer(412, {"error": "exists"}) if exists else None
    if_match = headers.get("If-Match")
    if if_match is None:
        return _json_answer(428, {"error": "If-Match required"})
    if entry is None or not exists or if_match != f'"{entry["version"]}"':
        return _json_answer(412, {"error": "stale"})
    return None
