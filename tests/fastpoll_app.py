"""console.asgi's poll front over the same Django application, with every answer Django
gave marked (`X-Test-Served-By: django`, added outside the front, which must not learn it),
so a test sees which side answered. Served by a real uvicorn in
tests/test_api_poll_fastpath.py."""

from __future__ import annotations

from typing import Any

from console.asgi import django_application  # isort: skip  # first: it sets Django up

from approvals.api.fastpoll import PollFront, Receive, Scope, Send

MARK = (b"x-test-served-by", b"django")
_REACHED = "x_test_django_reached"


async def _noting_django(scope: Scope, receive: Receive, send: Send) -> None:
    scope[_REACHED] = True
    await django_application(scope, receive, send)


front = PollFront(_noting_django)


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    async def marking(message: Any) -> None:
        if message["type"] == "http.response.start" and scope.get(_REACHED):
            message = {**message, "headers": [*message.get("headers", []), MARK]}
        await send(message)

    await front(scope, receive, marking)
