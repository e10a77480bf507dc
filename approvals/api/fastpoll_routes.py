"""The read front's route table (approvals/api/fastpoll.py): each authenticated agent GET it
answers, with the Bearer of Django's own view (which token kinds it accepts), the statement
it reads and the serializer it renders with — the ones Django's view uses.

A route reads in ONE statement the token's candidates (console.auth's rule: the run token's
run, or the agent token's live token, its agent active) joined with the object (the resource
list: with the page), checks the token's hash in constant time and who may read the object
with the selectors' own scope rules, and renders the body with the API's serializer. Anything
it cannot answer as Django would — an unknown token, an invisible object, an agent token whose
use must be recorded (`last_used_at`), a body that needs another read — is None: Django
answers.
"""

from __future__ import annotations

import functools
import hmac
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import TooManyFieldsSent
from django.db import DEFAULT_DB_ALIAS
from django.http import QueryDict
from django.utils import timezone

from approvals.api.actions import ActionState
from approvals.api.fastpoll_sql import Statement, Statements, model_from_row
from approvals.api.runs import run_state_of
from approvals.api.serialize import action_body
from approvals.models import Action, Agent, Run
from approvals.selectors import (
    agent_token_action_scope,
    run_token_action_scope,
    token_run_scope,
)
from approvals.services.queued_writes import QueuedWrite, superseding_write
from approvals.services.tokens import (
    AGENT_PREFIX,
    LOOKUP_PREFIX_LENGTH,
    RUN_PREFIX,
    Principal,
    token_digest,
    token_needs_touch,
)
from console.api_support import (
    PAGE_LIMIT_DEFAULT,
    PAGE_LIMIT_MAX,
    RESOURCE_CURSOR_PATTERN,
    json_bytes,
    keyset_page,
    page_json,
)
from console.auth import (
    AGENT,
    RUN,
    Bearer,
    any_token,
    any_token_or_ended_run,
    any_token_or_ended_run_deferred,
    run_has_ended,
)
from ownership.api.resources import BY_KIND_AND_NAME, QUEUED_ACTION_HEADER
from ownership.api.schemas import KIND_PATTERN, NAME_PATTERN, PREFIX_PATTERN
from ownership.api.serialize import ListedResource, resource_json
from ownership.models import Resource, ResourceKind
from ownership.targets import is_external

Rows = Callable[[str, tuple[Any, ...]], Awaitable[list[tuple[Any, ...]]]]
Reader = Run | Agent

_UUID = r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
# The token kinds the front looks up itself, by their prefix; a personal token goes to Django.
_KINDS = {RUN_PREFIX: RUN, AGENT_PREFIX: AGENT}


def token_kind(token: str) -> str | None:
    """RUN or AGENT for a token the front looks up itself, else None (Django answers)."""
    return next((kind for prefix, kind in _KINDS.items() if token.startswith(prefix)), None)


@dataclass(frozen=True)
class Read:
    """What a route answers from: the path's values by name ("id", or "kind" and "name")
    and the bearer's token."""

    path: dict[str, Any]
    token: str
    kind: str  # RUN or AGENT


@dataclass(frozen=True)
class Answer(ActionState):
    """A read's answer, with the headers it has beyond Django's constant ones and ETag (the
    front learns Django's headers per set of these names and fills in their values)."""

    headers: tuple[tuple[bytes, bytes], ...] = ()


class Route:
    """One GET the front answers: its path, the Bearer of Django's view, whether it holds a
    `Prefer: wait=N` poll itself, and its reads."""

    name: str
    pattern: re.Pattern[str]
    bearer: Bearer
    holds: bool = False
    channel_is_run: bool = False
    # Headers only some of its answers have (their values per answer).
    per_answer: frozenset[bytes] = frozenset()
    # Whether its answers carry an ETag (and If-None-Match gets a 304): the headers the front
    # fills in per answer are these and the ones every answer has (Content-Length,
    # X-Request-Id).
    tagged: bool = True

    def serves(self, kind: str) -> bool:
        """Whether the front answers this token kind here: a kind Django's Bearer accepts
        (403 otherwise: Django's)."""
        return kind in self.bearer.kinds

    def values(self, match: re.Match[str], query: bytes) -> dict[str, Any] | None:
        """What the read is of: the path's values (and the query's), or None: Django answers
        (here, any query string)."""
        return None if query else self.path_values(match)

    def path_values(self, match: re.Match[str]) -> dict[str, Any]:
        return {"id": uuid.UUID(match.group(1))}

    async def state(self, rows: Rows, read: Read) -> ActionState | None:
        """The object's tag (and whether it is final) without a body where that is cheaper,
        or None: Django answers."""
        return await self.full(rows, read)

    async def full(self, rows: Rows, read: Read) -> ActionState | None:
        """The object's answer with its body, or None: Django answers."""
        raise NotImplementedError


@functools.cache
def statements() -> Statements:
    """Built at the first request: the models' metadata and the token queryset are ready."""
    return Statements()


async def _token_rows(
    rows: Rows, chosen: Statement, read: Read, bearer: Bearer
) -> tuple[Reader, list[tuple[Any, ...]]] | None:
    """The token's reader (its run, or its agent) and the rest of each of its rows (one, or
    a list's page), or None."""
    source = statements().tokens[read.kind]
    now = timezone.now()
    prefix = read.token[:LOOKUP_PREFIX_LENGTH]
    found = await rows(chosen.sql, chosen.bind({"prefix": prefix, "now": now, **read.path}))
    digest = token_digest(read.token)
    width, hash_at = len(source.fields), source.hash_at
    # Every candidate's every row compared, in constant time, as principal_for_token does.
    matched = [row for row in found if hmac.compare_digest(row[hash_at], digest)]
    if not matched:
        return None
    token = matched[0][:width]
    rest = [row[width:] for row in matched]
    if read.kind == RUN:
        run: Run = model_from_row(Run, source.fields, token)
        principal = Principal(kind=RUN, token_prefix=prefix, run=run)
        if not bearer.ended_run and run_has_ended(principal):
            return None  # a dead credential here: Django's 401
        return run, rest
    values = dict(zip((name for name, _ in source.fields), token, strict=True))
    if token_needs_touch(values["last_used_at"], now):
        return None  # its use must be recorded: Django's authentication writes it
    agent = Agent.from_db(DEFAULT_DB_ALIAS, ["id"], [values["agent_id"]])
    return agent, rest


async def _token_row(
    rows: Rows, statement: dict[str, Statement], read: Read, bearer: Bearer
) -> tuple[Reader, tuple[Any, ...]] | None:
    """The token's reader and the rest of its one row (a statement per token kind), or None."""
    found = await _token_rows(rows, statement[read.kind], read, bearer)
    if found is None:
        return None
    reader, rest = found
    return reader, rest[-1]


def _within(row: Any, scope: dict[str, Any]) -> bool:
    """The selector's scope rule (column values a visible row has), checked on a row read."""
    return all(getattr(row, name) == value for name, value in scope.items())


class ActionRoute(Route):
    """`GET /api/v1/actions/{id}` (approvals.api.actions.action_get): the short poll and the
    held one; who reads what is actions_visible_to's rule (an agent its own actions, a run
    token its agent's, or its run's once ended)."""

    name = "action"
    pattern = re.compile(rf"/api/v1/actions/{_UUID}")
    bearer = any_token_or_ended_run_deferred
    holds = True

    @staticmethod
    def _visible(action: Action, reader: Reader) -> bool:
        if isinstance(reader, Run):
            return _within(action, run_token_action_scope(reader))
        return _within(action, agent_token_action_scope(reader))

    async def state(self, rows: Rows, read: Read) -> ActionState | None:
        sql = statements()
        found = await _token_row(rows, sql.state_sql, read, self.bearer)
        if found is None:
            return None
        reader, rest = found
        action = model_from_row(Action, sql.state_fields, rest)
        if not self._visible(action, reader):
            return None
        return ActionState(action.etag, action.is_final, b"")

    async def full(self, rows: Rows, read: Read) -> ActionState | None:
        """A body that needs another read (an undo's state) raises SynchronousOnlyOperation:
        Django answers."""
        sql = statements()
        found = await _token_row(rows, sql.body_sql, read, self.bearer)
        if found is None:
            return None
        reader, rest = found
        action = _action(sql, rest)
        if action is None or not self._visible(action, reader):
            return None
        return ActionState(action.etag, action.is_final, action_body(action))


def _action(sql: Statements, row: tuple[Any, ...]) -> Action | None:
    at = 0
    parts: list[Any] = []
    for fields in (sql.action_fields, sql.action_run_fields, sql.agent_fields):
        parts.append(row[at : at + len(fields)])
        at += len(fields)
    if parts[0][0] is None:
        return None  # no such action
    action: Action = model_from_row(Action, sql.action_fields, parts[0])
    action_run = model_from_row(Run, sql.action_run_fields, parts[1])
    Run._meta.get_field("agent").set_cached_value(
        action_run, model_from_row(Agent, sql.agent_fields, parts[2])
    )
    Action._meta.get_field("run").set_cached_value(action, action_run)
    for name, value in zip(sql.fact_names, row[at:], strict=True):
        setattr(action, name, value)
    return action


class RunRoute(Route):
    """`GET /api/v1/runs/{id}` (approvals.api.runs.run_get), short polls only (a held run
    poll, which also wakes at the run's expiry, goes to Django); who reads what is
    run_list_for_actor's rule (a run token its own run, an agent token its agent's runs).
    The ETag is a digest of the body: the 304 costs the body too, in the same statement."""

    name = "run"
    pattern = re.compile(rf"/api/v1/runs/{_UUID}")
    bearer = any_token_or_ended_run

    async def full(self, rows: Rows, read: Read) -> ActionState | None:
        sql = statements()
        found = await _token_row(rows, sql.run_sql, read, self.bearer)
        if found is None:
            return None
        reader, rest = found
        width = len(sql.run_fields)
        if rest[0] is None:
            return None  # no such run
        run = model_from_row(Run, sql.run_fields, rest[:width])
        if not _within(run, token_run_scope(reader)):
            return None
        Run._meta.get_field("agent").set_cached_value(
            run, model_from_row(Agent, sql.agent_fields, rest[width:])
        )
        state = run_state_of(run)
        return ActionState(state.etag, False, state.body)


class ResourceRoute(Route):
    """`GET /api/v1/resources/{kind}/{name}` (ownership.api.resources.resource_get) of a
    managed kind (an external kind is read through from its target: Django's), with the
    approved write already queued over the version read (Airlock-Queued-Action:
    queued_writes.superseding_write over in_flight_on's rows). Any live token reads any
    resource; a run token only while its run has not ended."""

    name = "resource"
    pattern = re.compile(
        rf"/api/v1/resources/({KIND_PATTERN.strip('^$')})/({NAME_PATTERN.strip('^$')})"
    )
    bearer = any_token
    per_answer = frozenset({QUEUED_ACTION_HEADER.lower().encode()})

    def path_values(self, match: re.Match[str]) -> dict[str, Any]:
        return {"kind": match.group(1), "name": match.group(2)}

    async def full(self, rows: Rows, read: Read) -> ActionState | None:
        sql = statements()
        found = await _token_row(rows, sql.resource_sql, read, self.bearer)
        if found is None:
            return None
        _, rest = found
        kinds, resources = len(sql.kind_fields), len(sql.resource_fields)
        if rest[0] is None:
            return None  # no such kind
        kind = model_from_row(ResourceKind, sql.kind_fields, rest[:kinds])
        if is_external(kind) or rest[kinds] is None:
            return None  # read through its target, or no such resource: Django's
        resource: Resource = model_from_row(
            Resource, sql.resource_fields, rest[kinds : kinds + resources]
        )
        writes = [
            QueuedWrite(uuid.UUID(str(id_)), operation, observed)
            for id_, operation, observed in rest[kinds + resources] or []
        ]
        queued = superseding_write(writes, creating=False, observed_version=resource.token)
        extra = () if queued is None else ((self._queued, str(queued.id).encode()),)
        body = json_bytes(resource_json(resource))
        return Answer(resource.etag, True, body, extra)

    _queued = QUEUED_ACTION_HEADER.lower().encode()


class ListRoute(Route):
    """`GET /api/v1/resources` (ownership.api.resources.resource_list): a page of the live
    resources (resources_listed), by kind and name (BY_KIND_AND_NAME, keyset_page_query and
    keyset_page, the view's), rendered by page_json with resource_json. Any live token lists
    every resource; a run token only while its run has not ended. No ETag: If-None-Match
    changes nothing, as on Django's.

    The query is parsed by Django's own QueryDict; the front answers only a query whose every
    parameter is the view's, given once, non-empty and valid by the view's own patterns (a
    limit in plain digits within its bounds). Anything else — another parameter, an empty or
    repeated one, a value the view would refuse (422), a limit written otherwise — is
    Django's."""

    name = "resources"
    pattern = re.compile(r"/api/v1/resources")
    bearer = any_token
    tagged = False
    # The view's query parameters: (the front's name for the value, its pattern).
    parameters = {
        "kind": ("kind", re.compile(KIND_PATTERN)),
        "prefix": ("name_prefix", re.compile(PREFIX_PATTERN)),
        "cursor": ("cursor", re.compile(RESOURCE_CURSOR_PATTERN)),
        "limit": ("limit", re.compile(r"^[1-9][0-9]{0,2}$")),
    }

    def values(self, match: re.Match[str], query: bytes) -> dict[str, Any] | None:
        try:
            query_dict = QueryDict(query.decode("ascii"))
        except (UnicodeDecodeError, TooManyFieldsSent):
            return None
        values: dict[str, Any] = {"limit": PAGE_LIMIT_DEFAULT}
        for parameter, sent in query_dict.lists():
            known = self.parameters.get(parameter)
            if known is None or len(sent) != 1 or not sent[0]:
                return None
            name, valid = known
            if not valid.fullmatch(sent[0]):
                return None
            values[name] = sent[0]
        values["limit"] = int(values["limit"])
        if values["limit"] > PAGE_LIMIT_MAX:
            return None
        cursor = values.pop("cursor", None)
        if cursor is not None:  # a position after which the page starts: the view's decode
            for at, value in enumerate(BY_KIND_AND_NAME.decode(cursor)):
                values[f"after{at}"] = value
        given = {name for name in ("kind", "name_prefix") if name in values}
        values["given"] = frozenset(given | ({"after"} if cursor is not None else set()))
        return values

    async def full(self, rows: Rows, read: Read) -> ActionState | None:
        limit: int = read.path["limit"]
        statement = statements().listing(read.kind, read.path["given"], limit)
        found = await _token_rows(rows, statement, read, self.bearer)
        if found is None:
            return None
        _, rest = found
        listed = [ListedResource(*row) for row in rest if row[0] is not None]
        page, next_cursor = keyset_page(listed, keyset=BY_KIND_AND_NAME, limit=limit)
        return ActionState("", True, json_bytes(page_json(page, next_cursor, resource_json)))


# The table: the first route whose pattern matches the whole path answers.
ROUTES: tuple[Route, ...] = (ActionRoute(), RunRoute(), ResourceRoute(), ListRoute())


def route_for(path: str, query: bytes = b"") -> tuple[Route, dict[str, Any]] | None:
    """The route that answers `path` with the query string `query`, and what it reads; or
    None: Django answers."""
    for route in ROUTES:
        match = route.pattern.fullmatch(path)
        if match is not None:
            values = route.values(match, query)
            return None if values is None else (route, values)
    return None
