"""A real HTTP server in front of the live Airlock: it forwards every request and passes
the answer back, except the first request matching its `method` and path `prefix`,
which it treats as its `mode` says:

- `503_after`: forwarded (the server acts and commits), then answered `503 unavailable`
  the way Airlock answers when its connection to the database broke at COMMIT;
- `429_before`: answered `429 rate_limited` without forwarding (nothing happened);
- `slow_after`: forwarded, then the answer held `hold` seconds (past the client's read
  timeout) before it is passed on.

Every request it received is kept in `seen` (method, path, headers)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import httpx

Mode = Literal["503_after", "429_before", "slow_after"]
_HOP_BY_HOP = {"connection", "transfer-encoding", "content-length", "keep-alive", "host"}


def _problem(status: int, code: str, detail: str) -> tuple[int, dict[str, str], bytes]:
    body = {
        "type": f"/api/v1/problems/{code}",
        "title": code,
        "status": status,
        "detail": detail,
        "code": code,
        "retryable": True,
        "retry_after": 1,
    }
    headers = {"Content-Type": "application/problem+json", "Retry-After": "1"}
    return status, headers, json.dumps(body).encode()


class Relay:
    def __init__(
        self, upstream: str, *, method: str, prefix: str, mode: Mode, hold: float = 0.0
    ) -> None:
        self.upstream = httpx.Client(base_url=upstream, timeout=120)
        self.method, self.prefix, self.mode, self.hold = method, prefix, mode, hold
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.tampered = 0
        self._lock = threading.Lock()
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                relay.handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def count(self, method: str, prefix: str) -> int:
        with self._lock:
            return sum(1 for m, path, _ in self.seen if m == method and path.startswith(prefix))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.upstream.close()

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        with self._lock:
            self.seen.append((handler.command, handler.path, headers))
            tamper = (
                not self.tampered
                and handler.command == self.method
                and handler.path.startswith(self.prefix)
            )
            self.tampered += int(tamper)
        if tamper and self.mode == "429_before":
            self._answer(handler, *_problem(429, "rate_limited", "Too many writes."))
            return
        upstream = self.upstream.request(
            handler.command, handler.path, headers=headers, content=body
        )
        if tamper and self.mode == "503_after":
            detail = "The database is unavailable; nothing was written. Try again shortly."
            self._answer(handler, *_problem(503, "unavailable", detail))
            return
        if tamper and self.mode == "slow_after":
            time.sleep(self.hold)
        answer_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        answer_headers.pop("content-encoding", None)
        self._answer(handler, upstream.status_code, answer_headers, upstream.content)

    @staticmethod
    def _answer(
        handler: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes
    ) -> None:
        with contextlib.suppress(OSError):
            handler.send_response(status)
            for name, value in headers.items():
                handler.send_header(name, value)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
