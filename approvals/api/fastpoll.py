"""The agent's reads, answered in front of Django: every route of the route table
(approvals/api/fastpoll_routes.py) — `GET /api/v1/actions/{id}` (the short poll and the held
one, `Prefer: wait=N`), `GET /api/v1/runs/{id}`, `GET /api/v1/resources/{kind}/{name}` of a
managed kind and the resource list's pages (`GET /api/v1/resources?kind=…&prefix=…&limit=…&
cursor=…`) — with a run token (`rt_`) or an agent token (`ak_`), as each route's Bearer
accepts them.

Those reads are most of an agent's traffic, and Django's ASGI path (request object, ninja,
middlewares, a thread hop, the ORM compiling querysets) costs several times the read itself.
`PollFront` wraps the ASGI application: for the happy path it runs ONE prepared statement on
a few async psycopg connections of its own (the token's candidates joined with the object
and everything its body shows) and answers on the event loop — a 304 before any JSON work
where the route can. Any other request, and any doubt about this one (a personal or unknown
token, an invisible or unknown object, an agent token whose use must be recorded, a body
that needs more reads, a database error, a header or a query it does not parse), goes to
Django unchanged, which then answers exactly as it always did. Rate limiting and audit stay off
this read path, as on Django's. tests/test_api_read_front.py compares the two on every
route, token kind and case.

Nothing here is a second copy of a rule: the token is parsed by `console.auth.bearer_token`
and checked against the same SHA-256 (`token_digest`, constant-time compare) among the
candidates of the same lookups (an agent token's: `agent_token_candidates`' SQL), who reads
what is the selectors' scope rules (`run_token_action_scope`, `agent_token_action_scope`,
`token_run_scope`, `resource_live`, `resources_listed`), a list's order and pages the
view's (`keyset_page_query`, `keyset_page`), the bodies and ETags the API's serializers', and
the answer's headers are the ones Django itself sent for the route's previous 200/304 with
the same token kind in this process (middlewares' security headers, CSP, Cache-Control,
Content-Type), with only ETag (where the route has one), Content-Length, X-Request-Id
(`clean_request_id`) and a route's per-answer headers (Airlock-Queued-Action) filled in per
answer. Until Django has answered once, every such read goes to Django — but a held poll:
Django answers a stand-in of the first one the front holds, while it waits, so the front
already knows the answer's headers when the poll is woken.

A held action poll waits as Django's does — `approvals.api.longpoll.hold` (woken by the
action's pub/sub channel, no database connection held while waiting) with
`action_should_hold` — but each read is the one statement on the event loop instead of the
ORM behind a thread hop: an approval reaches a waiting agent without Django. Its answer
replays Django's own held answer (Preference-Applied filled in). A body that needs Django (an
undo's state) once the wait has begun hands the poll to Django, which reads again and, if the
action still holds, waits again: at most twice the wait, in that one case. Held run polls
(which also wake at the run's expiry) are Django's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from django.conf import settings
from django.core.exceptions import SynchronousOnlyOperation
from django.db import DEFAULT_DB_ALIAS, connections
from django.http.request import split_domain_port, validate_host

from approvals.api.actions import ActionState, action_should_hold
from approvals.api.fastpoll_routes import Answer, Read, Route, route_for, token_kind
from approvals.api.fastpoll_sql import Connections, connection_kwargs
from approvals.api.longpoll import hold, parse_prefer_wait
from approvals.services.preconditions import TagCondition, read_condition
from console.auth import bearer_token
from console.problems import ApiError
from console.requestctx import clean_request_id

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

Scope = dict[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The headers Django fills in per answer; every other one is replayed as Django sent it.
_PER_ANSWER = (b"etag", b"content-length", b"x-request-id")
# ... on a route whose answers carry no ETag (Route.tagged: the resource list).
_PER_UNTAGGED_ANSWER = (b"content-length", b"x-request-id")
# ... and a held poll's answer, Preference-Applied (wait=N).
_PREFERENCE = b"preference-applied"
# Headers the fast path reads; a request repeating one of them goes to Django.
_READ = frozenset({b"host", b"authorization", b"if-none-match", b"x-request-id", b"prefer"})
# With one of these (or a body) Django may answer differently: it answers.
_HANDS_OFF = frozenset({b"cookie", b"content-length", b"transfer-encoding"})


Template = tuple[str, str, int, str, bool, tuple[bytes, ...]]


class Reply(NamedTuple):
    """The front's answer: status, ETag, body and the route's per-answer headers it has."""

    status: int
    etag: str
    body: bytes
    extra: tuple[tuple[bytes, bytes], ...] = ()

    @property
    def extra_names(self) -> tuple[bytes, ...]:
        return tuple(sorted(name for name, _ in self.extra))


def _extra(state: ActionState) -> tuple[tuple[bytes, bytes], ...]:
    return state.headers if isinstance(state, Answer) else ()


@dataclass(frozen=True)
class Poll:
    """The parts of a request the fast path answers from."""

    route: Route
    read: Read
    condition: TagCondition | None
    request_id: str
    scheme: str  # the learned headers are per scheme (HSTS is sent over HTTPS only)
    wait: int | None  # Prefer: wait=N (None: no wait asked; 0: asked, not held)

    @property
    def object_id(self) -> uuid.UUID:
        object_id: uuid.UUID = self.read.path["id"]
        return object_id

    def template(self, status: int, extra: tuple[bytes, ...] = ()) -> Template:
        """The key of the learned headers for this poll's answer with `status`: per route and
        token kind (Django's answers are learned for each), status, scheme, held or not, and
        which of the route's per-answer headers the answer has."""
        return self.route.name, self.read.kind, status, self.scheme, self.wait is not None, extra


class _HandOff(Exception):
    """A read of a held poll that the fast path cannot answer."""


class _ClientGone(Exception):
    """The client of a held poll went away before its answer."""


class _DisconnectWatch:
    """Reads a held poll's request messages while it waits, so that a client gone away ends
    the hold — as Django's handler cancels a view whose client left — instead of the poll
    being held, and re-read, to the end of its wait. What it read of the request is replayed
    to whoever reads it next (Django, when the front hands the poll over)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._read: list[Message] = []

    async def _gone(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return
            self._read.append(message)

    async def unless_gone(self, work: Coroutine[Any, Any, _T]) -> _T:
        """`work`'s result, or _ClientGone (`work` cancelled) if the client leaves first."""
        answering = asyncio.ensure_future(work)
        watching = asyncio.ensure_future(self._gone())
        try:
            await asyncio.wait({answering, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (answering, watching):
                if not task.done():
                    task.cancel()
            await asyncio.gather(answering, watching, return_exceptions=True)
        if answering.cancelled():
            raise _ClientGone
        return answering.result()

    def replaying(self) -> Receive:
        read = self._read

        async def receive() -> Message:
            return read.pop(0) if read else await self._receive()

        return receive


class PollFront:
    """ASGI middleware: fast short polls, everything else to `app` (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.templates: dict[Template, list[tuple[bytes, bytes]]] = {}
        # Templates being learned now: set once Django's answer has gone out.
        self._learning_now: dict[Template, asyncio.Event] = {}
        self._learning_tasks: set[asyncio.Future[None]] = set()
        self._connections: Connections | None = None
        # The embedded default (SQLite) has no async driver here: Django answers every poll.
        self.enabled = connections[DEFAULT_DB_ALIAS].vendor == "postgresql"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        poll = self._parse(scope) if self.enabled and scope["type"] == "http" else None
        if poll is None:
            await self.app(scope, receive, send)
            return
        answer: Reply | None = None
        # A held poll waits in front even before its answer's headers are learned.
        if poll.wait or self._learned(poll):
            watch = _DisconnectWatch(receive) if poll.wait else None
            try:
                if watch is None:
                    answer = await self._answer(poll, scope)
                else:
                    answer = await watch.unless_gone(self._answer(poll, scope))
            except _ClientGone:
                return
            except Exception:  # Django answers any doubt itself
                logger.debug("fast poll handed to Django", exc_info=True)
            if watch is not None:
                receive = watch.replaying()
        if answer is None:
            await self.app(scope, receive, self._learning(poll, send))
            return
        key = poll.template(answer.status, answer.extra_names)
        if not await self._template_ready(key):
            # The first held answer of its kind: the wait is over, so Django answers it at
            # once (wait=0) and the front learns its headers (Preference-Applied restored).
            await self._learn_from_django(key, poll, scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": self._headers(poll, key, answer),
            }
        )
        await send({"type": "http.response.body", "body": answer.body})

    # --- the request ---------------------------------------------------------------------

    def _parse(self, scope: Scope) -> Poll | None:
        """The poll's parts, or None when this request is not one the fast path serves."""
        if scope["method"] != "GET" or scope.get("root_path"):
            return None
        routed = route_for(scope["path"], scope.get("query_string") or b"")
        if routed is None:
            return None
        route, path = routed
        headers: dict[bytes, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name = raw_name.lower()
            if name in _HANDS_OFF or (name in _READ and name in headers):
                return None
            if name in _READ:
                headers[name] = raw_value.decode("latin-1")
            elif name == _proxy_ssl_header():
                return None  # HTTPS as a proxy says: Django judges (HSTS, redirects)
        token = bearer_token(headers.get(b"authorization", ""))
        kind = token_kind(token) if token is not None else None
        host = headers.get(b"host")
        if token is None or kind is None or not route.serves(kind) or host is None:
            return None
        domain, _ = split_domain_port(host)
        if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
            return None  # Django's 400 (DisallowedHost)
        scheme = str(scope.get("scheme", "http"))
        if settings.SECURE_SSL_REDIRECT and scheme != "https":
            return None
        try:
            wait = parse_prefer_wait(headers.get(b"prefer"))
        except ApiError:
            return None  # Django's 400, after authentication
        if wait is not None and not route.holds:
            return None  # Django holds (or answers at once) what the front does not hold
        return Poll(
            route=route,
            read=Read(path=path, token=token, kind=kind),
            # Where Django's answers have no ETag, its view never reads If-None-Match.
            condition=read_condition(headers.get(b"if-none-match")) if route.tagged else None,
            request_id=clean_request_id(headers.get(b"x-request-id")),
            scheme=scheme,
            wait=wait,
        )

    def _learned(self, poll: Poll) -> bool:
        return poll.template(200) in self.templates and (
            poll.condition is None or poll.template(304) in self.templates
        )

    # --- the answer -----------------------------------------------------------------------

    async def _rows(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if self._connections is None:
            size = settings.AIRLOCK_FAST_POLL_CONNECTIONS
            self._connections = Connections(connection_kwargs(), size)
        return await self._connections.rows(sql, params)

    async def _answer(self, poll: Poll, scope: Scope) -> Reply | None:
        """The poll's answer, or None: Django answers. A held poll waits as
        approvals.api.actions.action_get does, then answers what it last read."""
        condition = poll.condition
        if poll.wait:
            state = await hold(
                channel=poll.object_id,
                run=poll.route.channel_is_run,
                wait=poll.wait,
                read=lambda woken: self._held_read(poll, woken, scope),
                should_hold=lambda state: action_should_hold(state, condition),
            )
            if state.body and not action_should_hold(state, condition):
                return Reply(200, state.etag, state.body, _extra(state))
            # The wait is over with nothing to show: the poll's answer now, read afresh.
        if condition is not None:
            tag = await self._state(poll)
            if tag is None:
                return None
            if condition.weak_match(tag.etag):
                return Reply(304, tag.etag, b"", _extra(tag))
        full = await self._full(poll)
        if full is None:
            return None
        if condition is not None and condition.weak_match(full.etag):
            return Reply(304, full.etag, b"", _extra(full))
        return Reply(200, full.etag, full.body, _extra(full))

    async def _held_read(self, poll: Poll, woken: bool, scope: Scope) -> ActionState:
        """One read of a held poll. Woken by a publish (the action most likely changed):
        the answer in one statement, as action_get's woken read. Otherwise the tag first (one
        statement, no body) and the body only once the poll stops holding."""
        if woken:
            try:
                full = await self._full(poll)
            except SynchronousOnlyOperation:
                full = None  # a body that needs Django: hand off only if the wait is over
            if full is not None:
                return full
        state = await self._state(poll)
        if state is None:
            raise _HandOff
        if action_should_hold(state, poll.condition):
            self._learn_while_held(poll, scope)
            return state
        full = await self._full(poll)
        if full is None:
            raise _HandOff
        return full

    async def _state(self, poll: Poll) -> ActionState | None:
        """The object's tag and whether it is final (no body where the route can), or None:
        Django answers."""
        return await poll.route.state(self._rows, poll.read)

    async def _full(self, poll: Poll) -> ActionState | None:
        """The object with its body, or None: Django answers."""
        return await poll.route.full(self._rows, poll.read)

    # --- the headers, as Django sent them ----------------------------------------------------

    def _learn_while_held(self, poll: Poll, scope: Scope) -> None:
        """Learn the headers of the answer a held poll will get when it is woken (a 200), now
        that the front holds it (its token, action and visibility checked): Django answers a
        stand-in of the poll (`_stand_in`) while the poll waits. Learned at the wake-up
        instead, the first woken poll asks Django just when the decisions that woke it keep
        Django busy, and every wake-up of the process waits for that answer (measured in
        the bench's long-poll phase: 109 and 167 ms, the phase's slowest wake-ups)."""
        key = poll.template(200)
        if key in self.templates or key in self._learning_now:
            return
        task = asyncio.ensure_future(self._learn_from_stand_in(key, poll, scope))
        self._learning_tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._learning_tasks.discard)

    async def _learn_from_stand_in(self, key: Template, poll: Poll, scope: Scope) -> None:
        try:
            await self._learn_from_django(key, poll, _stand_in(scope), _empty_request(), _discard)
        except Exception:  # nothing learned: the first woken poll asks Django itself
            logger.debug("held answer's headers not learned ahead", exc_info=True)

    async def _template_ready(self, key: Template) -> bool:
        """Whether the headers of answers like `key` are known, after waiting for a poll that
        is learning them now: when many held polls wake at once in a fresh process, one asks
        Django and the rest wait the few milliseconds that takes, instead of all queueing for
        Django behind the decisions that woke them (seen: 120-600 ms wake-ups)."""
        learning = self._learning_now.get(key)
        if learning is not None:
            await learning.wait()
        return key in self.templates

    async def _learn_from_django(
        self, key: Template, poll: Poll, scope: Scope, receive: Receive, send: Send
    ) -> None:
        learning = self._learning_now.setdefault(key, asyncio.Event())
        try:
            await self.app(_waiting_no_more(scope), receive, self._learning(poll, send))
        finally:
            learning.set()
            if self._learning_now.get(key) is learning:
                del self._learning_now[key]

    def _learning(self, poll: Poll, send: Send) -> Send:
        """`send` that keeps the headers of Django's 200 and 304 answers to such polls (and
        says the poll's own Preference-Applied, when Django answered its wait=0 stand-in)."""
        applied = f"wait={poll.wait}".encode()

        async def learn(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in (200, 304):
                headers = [(bytes(n), bytes(v)) for n, v in message.get("headers", [])]
                if poll.wait is not None:
                    headers = [(n, applied if n.lower() == _PREFERENCE else v) for n, v in headers]
                    message = {**message, "headers": headers}
                names = {name.lower() for name, _ in headers}
                filled = _PER_ANSWER if poll.route.tagged else _PER_UNTAGGED_ANSWER
                # A cookie belongs to one client: an answer that sets one is never replayed.
                if names.issuperset(filled) and b"set-cookie" not in names:
                    extra = tuple(sorted(names & poll.route.per_answer))
                    self.templates[poll.template(message["status"], extra)] = headers
            await send(message)

        return learn

    def _headers(self, poll: Poll, key: Template, answer: Reply) -> list[Any]:
        values = {
            b"etag": answer.etag.encode("latin-1"),
            b"content-length": str(len(answer.body)).encode(),
            b"x-request-id": poll.request_id.encode("latin-1"),
            **dict(answer.extra),
        }
        if poll.wait is not None:
            values[_PREFERENCE] = f"wait={poll.wait}".encode()
        return [(name, values.get(name.lower(), value)) for name, value in self.templates[key]]


def _waiting_no_more(scope: Scope) -> Scope:
    """The poll's scope, now asking Django for its answer without a wait (`Prefer: wait=0`;
    the request is the front's to change: it has read all it needs of it)."""
    scope["headers"] = [
        (n, b"wait=0" if n.lower() == b"prefer" else v) for n, v in scope["headers"]
    ]
    return scope


def _stand_in(scope: Scope) -> Scope:
    """A copy of a held poll's scope that asks Django for the action's answer in full: no
    If-None-Match (a 200, not a 304) and no X-Request-Id (Django gives the stand-in an id of
    its own, not the agent's). `_learn_from_django` asks it without a wait."""
    headers = [
        (name, value)
        for name, value in scope["headers"]
        if name.lower() not in (b"if-none-match", b"x-request-id")
    ]
    return {**scope, "headers": headers}


def _empty_request() -> Receive:
    """`receive` of a request with no body whose client never leaves (Django stops
    listening for the disconnect once it has answered)."""
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        never: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        return await never

    return receive


async def _discard(message: Message) -> None:
    """`send` of the stand-in: its answer is read for its headers only."""


def _proxy_ssl_header() -> bytes | None:
    header = settings.SECURE_PROXY_SSL_HEADER
    if not header:
        return None
    # Django's META name (HTTP_X_FORWARDED_PROTO) as the header's ASGI name.
    return header[0].removeprefix("HTTP_").replace("_", "-").lower().encode()
