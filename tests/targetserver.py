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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

# RFC 7396, as the product applies it (its own tests check it against the RFC's examples).
from ownership.diff import apply_merge_patch


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
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                payload = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                name = unquote(self.path.lstrip("/"))
                with server.lock:
                    entry = server.documents.get(name)
                if entry is None or entry["deleted"]:
                    self._reply(404, {"error": "not found"})
                    return
                self._reply(200, entry["document"], {"ETag": f'"{entry["version"]}"'})

            def _write(self) -> None:
                name = unquote(self.path.lstrip("/"))
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                key = self.headers.get("Idempotency-Key", "")
                fence = int(self.headers.get("Fencing-Token") or 0)
                hang = 0.0
                with server.lock:
                    server.requests.append(
                        {
                            "method": self.command,
                            "name": name,
                            "key": key,
                            "fence": fence,
                            "if_match": self.headers.get("If-Match"),
                        }
                    )
                    if server.scripted_failures:
                        status = server.scripted_failures.pop(0)
                        self._reply(status, {"error": "scripted"}, {"Retry-After": "0"})
                        return
                    if not key:
                        self._reply(400, {"error": "Idempotency-Key required"})
                        return
                    if key in server.replies:
                        status, headers, body = server.replies[key]
                        self.send_response(status)
                        for h, v in {**headers, "Idempotent-Replayed": "true"}.items():
                            self.send_header(h, v)
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        return
                    if fence < server.last_fence.get(name, 0):
                        self._reply(409, {"error": "stale fence"})
                        return
                    entry = server.documents.get(name)
                    exists = entry is not None and not entry["deleted"]
                    if self.headers.get("If-None-Match") == "*":
                        if exists:
                            self._reply(412, {"error": "exists"})
                            return
                    else:
                        if_match = self.headers.get("If-Match")
                        if if_match is None:
                            self._reply(428, {"error": "If-Match required"})
                            return
                        if not exists or if_match != f'"{entry["version"]}"':  # type: ignore[index]
                            self._reply(412, {"error": "stale"})
                            return
                    body = json.loads(raw) if raw else None
                    version = (entry["version"] if entry else 0) + 1
                    if self.command == "DELETE":
                        document, deleted = {}, True
                    elif self.command == "PATCH":
                        document, deleted = (
                            apply_merge_patch(entry["document"] if entry else {}, body),
                            False,
                        )
                    else:
                        document, deleted = body, False
                    server.documents[name] = {
                        "version": version,
                        "document": document,
                        "deleted": deleted,
                    }
                    server.last_fence[name] = fence
                    server.effects += 1
                    headers = {"ETag": f'"{version}"', "Content-Type": "application/json"}
                    payload = json.dumps(document).encode()
                    server.replies[key] = (200, headers, payload)
                    hang, server.hang_seconds = server.hang_seconds, 0.0
                if hang:
                    time.sleep(hang)
                try:
                    self.send_response(200)
                    for h, v in headers.items():
                        self.send_header(h, v)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_PUT = _write
            do_PATCH = _write
            do_DELETE = _write

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

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
