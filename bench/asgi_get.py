"""One request handed straight to an ASGI application in this process: no socket, no
server. Shared by bench.asgi_cpu (the cost of a poll), bench.proposal_cpu (of a write) and
the tests of console.middleware."""

from __future__ import annotations

import asyncio
from typing import Any

App = Any


async def asgi_get(
    app: App, path: str, *, host: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """The messages the application sent for one GET of `path` (start, then body parts)."""
    return await asgi_request(app, "GET", path, host=host, headers=headers)


async def asgi_request(
    app: App, method: str, path: str, *, host: str, headers: dict[str, str], body: bytes = b""
) -> list[dict[str, Any]]:
    """The messages the application sent for one request (start, then body parts); `path`
    may carry a query string."""
    path, _, query = path.partition("?")
    if body:
        headers = {**headers, "Content-Length": str(len(body))}
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", host.encode())]
        + [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 50000),
        "server": (host, 80),
    }
    messages: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if requested:  # the client stays connected until the answer is sent
            await asyncio.Event().wait()
        requested = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)
    return messages
