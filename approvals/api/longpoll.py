"""Conditional reads and long-polling (`Prefer: wait=N`, `If-None-Match`) of runs,
plans and actions: one hold loop, one answer builder, one route declaration."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

from django.db import connection
from django.utils import timezone
from ninja import Router, Schema
from ninja.types import TCallable

from approvals.notify import action_waiters
from console.problems import ApiError, errors

MAX_WAIT_SECONDS = 60
# While subscribed, a waiter still re-reads this often in case a wake-up was lost.
SAFETY_RECHECK_SECONDS = 15.0
# Without a live subscription (Redis down) a waiter polls the database this often.
UNSUBSCRIBED_RECHECK_SECONDS = 1.0

_WAIT = re.compile(r"^\s*wait\s*=\s*(\d{1,6})\s*$", re.I)

S = TypeVar("S")


def parse_prefer_wait(raw: str | None) -> int | None:
    """`Prefer: wait=N` (RFC 7240); other preferences are ignored. N over 60 is
    honoured as 60 (Preference-Applied says so). A malformed wait is a 400."""
    if not raw:
        return None
    wait: int | None = None
    for preference in raw.split(","):
        token = preference.split(";", 1)[0]
        if token.split("=", 1)[0].strip().lower() == "wait":
            match = _WAIT.match(token)
            if match is None:
                raise ApiError(
                    "Prefer: wait must be a whole number of seconds, e.g. wait=30.",
                    code="bad_header",
                    extra={"header": "Prefer"},
                )
            wait = min(int(match.group(1)), MAX_WAIT_SECONDS)
    return wait


def release_connection(close: bool) -> None:
    """Hand the connection back (to the pool) before the request waits."""
    if close and not connection.in_atomic_block:
        connection.close()


async def hold(
    *,
    channel: Any,
    run: bool,
    wait: int,
    read: Callable[[bool], Awaitable[S]],
    should_hold: Callable[[S], bool],
    changes_by_itself_at: Callable[[S], datetime | None] = lambda state: None,
) -> S:
    """Read, then re-read on every wake-up of `channel` (an action's or a run's
    pub/sub) while `should_hold` and `wait` seconds have not passed.

    `read(woken)`: woken is True when a publish (not a safety re-check) ended the
    wait, i.e. the object most likely changed: the reader may then fetch the whole
    answer in one go instead of checking its tag first.

    Subscribes before the first read, so a change committed in between still
    wakes us. `changes_by_itself_at`: a moment the state changes without any
    publish (an active run's expiry): the waiter re-reads then.
    """
    if run:
        event, live = await action_waiters.register_run(channel)
    else:
        event, live = await action_waiters.register(channel)
    try:
        state = await read(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        action_waiters.held += 1
        try:
            while should_hold(state):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                recheck = SAFETY_RECHECK_SECONDS if live else UNSUBSCRIBED_RECHECK_SECONDS
                timeout = min(remaining, recheck)
                moment = changes_by_itself_at(state)
                if moment is not None:
                    until = (moment - timezone.now()).total_seconds()
                    timeout = max(0.0, min(timeout, until + 0.05))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=timeout)
                woken = event.is_set()
                event.clear()
                state = await read(woken)
        finally:
            action_waiters.held -= 1
    finally:
        if run:
            action_waiters.unregister_run(channel, event)
        else:
            action_waiters.unregister(channel, event)
    return state


def _header_doc(name: str, description: str) -> dict[str, Any]:
    return {
        "in": "header",
        "name": name,
        "required": False,
        "schema": {"type": "string"},
        "description": description,
    }


def _prefer_doc(subject: str, holds: str) -> dict[str, Any]:
    return _header_doc(
        "Prefer",
        f"`wait=N` (N ≤ 60): hold the request until the {subject} changes "
        f"{holds} or N seconds pass. Answered with `Preference-Applied: wait=N`.",
    )


def _if_none_match_doc(subject: str) -> dict[str, Any]:
    return _header_doc(
        "If-None-Match",
        f"The {subject} ETag you hold: 304 while unchanged; with Prefer: wait, "
        "held while unchanged. A malformed value is ignored.",
    )


def _longpoll_responses(subject: str) -> dict[str, Any]:
    return {
        "200": {
            "description": f"The {subject}",
            "headers": {
                "ETag": {"schema": {"type": "string"}},
                "Preference-Applied": {"schema": {"type": "string"}},
            },
        },
        "304": {"description": "Not modified (ETag still matches If-None-Match)"},
    }


def longpoll_read(
    router: Router,
    path: str,
    *,
    out: type[Schema],
    subject: str,
    holds: str = "(see If-None-Match)",
    **route: Any,
) -> Callable[[TCallable], TCallable]:
    """Declare the GET of a long-polled `subject` (an action, a plan, a run): its
    answers (200 with ETag, 304, the problems) and its Prefer / If-None-Match headers
    are documented once for all of them. `holds`: how long a wait is held, in the
    words of the Prefer header's description."""
    return router.get(
        path,
        response={200: out, 304: None, **errors(400, 401, 403, 404, 422)},
        openapi_extra={
            "parameters": [_prefer_doc(subject, holds), _if_none_match_doc(subject)],
            "responses": _longpoll_responses(subject),
        },
        **route,
    )
