"""A tiny TCP proxy that loses the answer to one request: it forwards the request,
waits until the server has answered, then closes the client's connection without
passing the answer on (a response lost in the network after the server acted)."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit


class DroppingProxy:
    def __init__(self, upstream_url: str, *, drop_first: bytes) -> None:
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.drop_first = drop_first
        self.dropped = 0
        self._seen: list[bytes] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def requests_seen(self, prefix: bytes) -> int:
        with self._lock:
            return sum(1 for first in self._seen if first.startswith(prefix))

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            state = {"drop": False}
            threading.Thread(
                target=self._requests, args=(client, upstream, state), daemon=True
            ).start()
            threading.Thread(
                target=self._responses, args=(upstream, client, state), daemon=True
            ).start()

    def _requests(
        self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]
    ) -> None:
        with contextlib.suppress(OSError):
            while chunk := client.recv(65536):
                with self._lock:
                    for method in (b"GET ", b"POST ", b"PUT ", b"PATCH ", b"DELETE "):
                        if chunk.startswith(method):
                            self._seen.append(chunk[:16])
                            if method == self.drop_first and self.dropped == 0:
                                state["drop"] = True
                                self.dropped = 1
                upstream.sendall(chunk)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)

    def _responses(
        self, upstream: socket.socket, client: socket.socket, state: dict[str, bool]
    ) -> None:
        with contextlib.suppress(OSError):
            while chunk := upstream.recv(65536):
                if state["drop"]:
                    # The server has acted and answered: lose the answer.
                    break
                client.sendall(chunk)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
