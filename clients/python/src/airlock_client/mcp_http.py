"""The streamable-HTTP transport of `airlock-mcp`, guarded.

Whoever reaches this endpoint acts with the agent's Airlock token (starts runs, proposes
writes), so it is never open to the network: with a token (`AIRLOCK_MCP_TOKEN`, or
`--token`) every HTTP request must carry `Authorization: Bearer <token>` (compared in
constant time; anything else is `401`); without one it binds to a loopback address only,
and says so on stderr. A non-loopback `--host` without a token is refused at start.
"""

from __future__ import annotations

import hmac
import ipaddress
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

#: Shorter tokens are refused: a guessable token is no guard.
MIN_TOKEN_LENGTH = 16

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class ExposureRefused(SystemExit):
    """The HTTP transport would be reachable without a token (or with a weak one)."""

    def __init__(self, message: str) -> None:
        print(f"airlock-mcp: {message}", file=sys.stderr)
        super().__init__(2)
        self.message = message


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def check_exposure(host: str, token: str | None) -> None:
    """Refuse a token too short, or a non-loopback bind without one; warn (stderr) when
    serving on loopback without a token, where any local process can use the agent."""
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ExposureRefused(
            f"AIRLOCK_MCP_TOKEN / --token must be at least {MIN_TOKEN_LENGTH} characters "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)."
        )
    if token:
        return
    if not is_loopback(host):
        raise ExposureRefused(
            f"refusing to serve streamable HTTP on {host} without a token: anyone who reaches "
            "it acts as this agent. Set AIRLOCK_MCP_TOKEN (or --token), or bind to 127.0.0.1."
        )
    print(
        f"airlock-mcp: WARNING: serving streamable HTTP on {host} without a token; any local "
        "process can use this agent. Set AIRLOCK_MCP_TOKEN to require one.",
        file=sys.stderr,
    )


class BearerGuard:
    """ASGI middleware: a request without `Authorization: Bearer <token>` is answered 401
    (a websocket is closed) and never reaches the MCP app; only the lifespan passes."""

    def __init__(self, app: App, token: str) -> None:
        self.app = app
        self._token = token.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan" and not self._authorized(scope):
            if scope["type"] == "http":
                await _unauthorized(send)
            else:
                await send({"type": "websocket.close", "code": 1008})
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers") or []:
            if bytes(name).lower() == b"authorization":
                given = bytes(value)
        scheme, _, credentials = given.strip().partition(b" ")
        # Constant time in the token (compare_digest); the scheme is not secret.
        matches = hmac.compare_digest(credentials.strip(), self._token)
        return scheme.lower() == b"bearer" and matches


async def _unauthorized(send: Send) -> None:
    body = b'{"error": "unauthorized", "detail": "Send Authorization: Bearer <AIRLOCK_MCP_TOKEN>."}'
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="airlock-mcp"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def serve_http(app: App, *, host: str, port: int, token: str | None) -> None:
    """Serve the MCP app on host:port after `check_exposure`; behind `BearerGuard` when a
    token is set."""
    check_exposure(host, token)
    guarded = BearerGuard(app, token) if token else app
    uvicorn.run(guarded, host=host, port=port, log_level="warning")
