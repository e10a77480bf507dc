"""A real local HTTP receiver for the notification tests: a ThreadingHTTPServer on
127.0.0.1 that records every request and answers from a script (status codes, headers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    server: ThreadingHTTPServer
    received: list[Received] = field(default_factory=list)
    # Answers, in order; once used up, `default` (status, headers).
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    default: tuple[int, dict[str, str]] = (200, {})
    delay_seconds: float = 0.0
    # Answer no request before this many have arrived (up to 10 s): answers at one moment.
    together: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/hooks/airlock?token=t0ps3cret"

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def answer(self) -> tuple[int, dict[str, str]]:
        with self.lock:
            return self.script.pop(0) if self.script else self.default

    def wait_for(self, count: int, timeout: float = 20.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.received) >= count:
                return list(self.received)
            time.sleep(0.05)
        raise AssertionError(f"{len(self.received)} requests received, wanted {count}")


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            with receiver.lock:
                receiver.received.append(
                    Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
            if receiver.delay_seconds:
                time.sleep(receiver.delay_seconds)
            deadline = time.monotonic() + 10
            while len(receiver.received) < receiver.together and time.monotonic() < deadline:
                time.sleep(0.01)
            status, headers = receiver.answer()
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: object) -> None:
            return

    return Handler


@contextmanager
def running_receiver() -> Iterator[Receiver]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    receiver = Receiver(server)
    server.RequestHandlerClass = _handler(receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
