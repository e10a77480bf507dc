"""The read front's database side (approvals/api/fastpoll.py): its statements, built from
the models' metadata and the token lookups' and selectors' own querysets, and the few async
psycopg connections it runs them on."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

import psycopg
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Model, QuerySet
from django.db.models.lookups import StartsWith
from psycopg import AsyncConnection, AsyncCursor
from psycopg.types.json import set_json_loads

from approvals.api.serialize import body_facts
from approvals.models import Action, Agent, Run
from approvals.services.queued_writes import in_flight_on
from approvals.services.tokens import agent_token_candidates
from console.api_support import keyset_page_query
from console.auth import AGENT, RUN
from console.stale_plans import DEALLOCATE_ALL, is_stale_plan
from ownership.api.resources import BY_KIND_AND_NAME
from ownership.api.serialize import LISTED_COLUMNS
from ownership.models import Resource, ResourceKind
from ownership.selectors import resource_live, resources_listed

logger = logging.getLogger(__name__)


def _fields(
    model: type[Model],
    alias: str,
    *,
    only: frozenset[str] | None = None,
    exclude: frozenset[str] = frozenset(),
) -> list[tuple[str, str]]:
    """(attname, SQL column) of `model`'s concrete fields in their order (Model.from_db's);
    a field left out is deferred: reading it would be a query, which hands the poll over."""
    return [
        (field.attname, f'{alias}."{field.column}"')
        for field in model._meta.concrete_fields
        if (only is None or field.attname in only) and field.attname not in exclude
    ]


# Stand-ins for a request's values in a statement compiled from a queryset (`compiled`): the
# statement is compiled once, the request's values bound by name at each read.
_STAND_INS: dict[str, Any] = {
    "prefix": "\x00token-prefix",
    "now": datetime(1970, 1, 1, 0, 0, 7, tzinfo=UTC),
    "kind": "\x00resource-kind",
    "name": "\x00resource-name",
    "name_prefix": "\x00resource-name-prefix",
    # A keyset's position after which a page starts (a cursor's values), by place.
    "after0": "\x00keyset-after-0",
    "after1": "\x00keyset-after-1",
}
# A value bound to `name__startswith`: Django binds the pattern (its own escaping, then the
# lookup's wildcard, as lookups.PatternLookup.process_rhs does), not the value.
_STARTSWITH = "__startswith"


def _startswith_pattern(value: str) -> str:
    return StartsWith.param_pattern % connections[DEFAULT_DB_ALIAS].ops.prep_for_like_query(value)


@dataclass(frozen=True)
class Statement:
    """SQL with `%s` placeholders, and which request value each one takes (`slots`; a slot
    ending in `__startswith` takes the value's LIKE pattern)."""

    sql: str
    slots: tuple[str, ...]

    def bind(self, values: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(
            _startswith_pattern(values[slot.removesuffix(_STARTSWITH)])
            if slot.endswith(_STARTSWITH)
            else values[slot]
            for slot in self.slots
        )


def compiled(queryset: QuerySet[Any], alias: str) -> Statement:
    """`queryset` (built with the stand-ins of `_STAND_INS` for a request's values) as a
    subquery named `alias`: the selector's own SQL, compiled once."""
    sql, params = queryset.query.sql_with_params()
    forms = dict(_STAND_INS)
    forms.update(
        {
            slot + _STARTSWITH: _startswith_pattern(stand_in)
            for slot, stand_in in _STAND_INS.items()
            if isinstance(stand_in, str)
        }
    )
    slots: list[str] = []
    for value in params:
        named = [slot for slot, form in forms.items() if value == form]
        if len(named) != 1:  # pragma: no cover - a parameter this module must learn
            raise ImproperlyConfigured(f"read front: unexpected parameter {value!r} in {sql}")
        slots.append(named[0])
    return Statement(f"({sql}) {alias}", tuple(slots))


def stand_in(slot: str) -> Any:
    return _STAND_INS[slot]


@dataclass(frozen=True)
class TokenSource:
    """One token kind's candidate rows as a subquery `t` (a statement's FROM): the columns
    `fields` names, `token_hash` among them."""

    kind: str  # console.auth's RUN or AGENT
    fields: list[tuple[str, str]]
    rows: Statement

    @cached_property
    def hash_at(self) -> int:
        """Where the token's stored hash is in its columns."""
        return [name for name, _ in self.fields].index("token_hash")


def _run_tokens() -> TokenSource:
    """A run token's candidates: its run (what the token check, run_effective_status and
    the scopes read) whose agent is active (principal_for_token)."""
    run_table, agent_table = Run._meta.db_table, Agent._meta.db_table
    read = frozenset({"id", "agent_id", "token_hash", "status", "expires_at"})
    columns = _fields(Run, "r", only=read)
    sql = (
        "("
        + _select(columns, f'"{run_table}" r JOIN "{agent_table}" g ON g.id = r.agent_id ')
        + "AND g.is_active WHERE r.token_prefix = %s) t"
    )
    # The same columns in the same (the model's) order, as the subquery `t` names them.
    fields = _fields(Run, "t", only=read)
    return TokenSource(kind=RUN, fields=fields, rows=Statement(sql, ("prefix",)))


def _agent_tokens() -> TokenSource:
    """An agent token's candidates: tokens.agent_token_candidates' own SQL (live, agent
    active)."""
    names = ("agent_id", "token_hash", "last_used_at")
    candidates = agent_token_candidates(stand_in("prefix"), stand_in("now"))
    fields = [(name, f't."{name}"') for name in names]
    rows = compiled(candidates.values_list(*names), "t")
    return TokenSource(kind=AGENT, fields=fields, rows=rows)


class Statements:
    """The statements of the read front, built once from the models' metadata, the token
    lookups and the selectors: per token kind, an action's tag (the 304 check), an action
    with its body, a run with its agent's name, a resource with the writes queued on it."""

    def __init__(self) -> None:
        self.tokens = {source.kind: source for source in (_run_tokens(), _agent_tokens())}
        run_table = Run._meta.db_table
        agent_table = Agent._meta.db_table
        action_table = Action._meta.db_table
        # The 304 check: the action's revision and who may read it.
        self.state_fields = _fields(
            Action, "a", only=frozenset({"id", "run_id", "agent_id", "status", "revision"})
        )
        self.state_sql = self._per_token(
            self.state_fields, f'LEFT JOIN "{action_table}" a ON a.id = %s', ("id",)
        )
        # The 200: the row and its run's (for the body) plus the body's facts. The facts'
        # SQL names the action table itself, so the action is not aliased here.
        quoted = f'"{action_table}"'
        self.action_fields = _fields(Action, quoted, exclude=frozenset({"payload"}))
        self.run_fields = _fields(Run, "ar", exclude=frozenset({"token_hash"}))
        self.action_run_fields = _fields(
            Run, "ar", exclude=frozenset({"write_set", "task", "token_hash"})
        )
        self.agent_fields = [("id", "ag.id"), ("name", "ag.name")]
        facts = body_facts("postgresql")
        self.fact_names = [name for name, _ in facts]
        self.body_sql = self._per_token(
            self.action_fields + self.action_run_fields + self.agent_fields + facts,
            f"LEFT JOIN {quoted} ON {quoted}.id = %s "
            f'LEFT JOIN "{run_table}" ar ON ar.id = {quoted}.run_id '
            f'LEFT JOIN "{agent_table}" ag ON ag.id = ar.agent_id',
            ("id",),
        )
        # A run read: the run and its agent's name (run_json).
        self.run_sql = self._per_token(
            self.run_fields + self.agent_fields,
            f'LEFT JOIN "{run_table}" ar ON ar.id = %s '
            f'LEFT JOIN "{agent_table}" ag ON ag.id = ar.agent_id',
            ("id",),
        )
        self._resource_statements()
        # A page of the resource list: the columns resource_json renders (a ListedResource
        # each), of the rows the list's queryset selects. The first is never NULL in a row.
        columns = {field.attname: field.column for field in Resource._meta.concrete_fields}
        self.listed_fields = [(name, f'p."{columns[name]}"') for name in LISTED_COLUMNS]
        self._listings: dict[tuple[str, frozenset[str], int], Statement] = {}

    def _resource_statements(self) -> None:
        """A resource read: its kind's target (an external kind is read through: Django's),
        the live resource (resource_live's SQL) and the writes in flight on it
        (in_flight_on's SQL), as [[id, operation, observed_version], ...] oldest first."""
        kind_table = ResourceKind._meta.db_table
        self.kind_fields = [("slug", "k.slug"), ("target", "k.target")]
        live = resource_live(kind=stand_in("kind"), name=stand_in("name"))
        resource = compiled(live, "res")
        self.resource_fields = [
            (field.attname, f'res."{field.column}"') for field in Resource._meta.concrete_fields
        ]
        flight = in_flight_on(stand_in("kind"), stand_in("name"))
        writes = compiled(
            flight.values_list("id", "operation", "observed_version", "created_at"), "q"
        )
        aggregate = _select(
            [
                (
                    "writes",
                    "jsonb_agg(jsonb_build_array(q.id, q.operation, q.observed_version) "
                    "ORDER BY q.created_at, q.id) AS writes",
                )
            ],
            writes.sql,
        )
        self.resource_sql = self._per_token(
            [*self.kind_fields, *self.resource_fields, ("writes", "w.writes")],
            f'LEFT JOIN "{kind_table}" k ON k.slug = %s '
            f"LEFT JOIN LATERAL {resource.sql} ON true "
            f"LEFT JOIN LATERAL ({aggregate}) w ON true",
            ("kind", *resource.slots, *writes.slots),
        )

    def listing(self, kind: str, given: frozenset[str], limit: int) -> Statement:
        """A page of the resource list (GET /api/v1/resources) beside a token kind's
        candidates: keyset_page_query over resources_listed — the view's own queryset — with
        the filters `given` ("kind", "name_prefix", "after": a cursor) and `limit` (Django
        writes LIMIT as a literal: one statement per limit asked, compiled at its first
        use), every candidate's rows in the page's order (or one row of NULLs: no page)."""
        key = (kind, given, limit)
        statement = self._listings.get(key)
        if statement is not None:
            return statement
        page = keyset_page_query(
            resources_listed(
                kind=stand_in("kind") if "kind" in given else None,
                prefix=stand_in("name_prefix") if "name_prefix" in given else None,
            ),
            keyset=BY_KIND_AND_NAME,
            after=[stand_in(f"after{at}") for at, _ in enumerate(BY_KIND_AND_NAME.fields)]
            if "after" in given
            else None,
            limit=limit,
        )
        rows = compiled(page, "p")
        direction = "DESC" if BY_KIND_AND_NAME.descending else "ASC"
        columns = dict(self.listed_fields)
        order = ", ".join(f"{columns[name]} {direction}" for name in BY_KIND_AND_NAME.fields)
        source = self.tokens[kind]
        statement = Statement(
            _select(
                source.fields + self.listed_fields,
                f"{source.rows.sql} LEFT JOIN {rows.sql} ON true ORDER BY {order}",
            ),
            source.rows.slots + rows.slots,
        )
        self._listings[key] = statement
        return statement

    def _per_token(
        self, fields: list[tuple[str, str]], joins: str, slots: tuple[str, ...]
    ) -> dict[str, Statement]:
        """The statement, per token kind: the token's candidates joined with the object."""
        return {
            kind: Statement(
                _select(source.fields + fields, f"{source.rows.sql} {joins}"),
                source.rows.slots + slots,
            )
            for kind, source in self.tokens.items()
        }


def _select(fields: list[tuple[str, str]], tables: str) -> str:
    # Model metadata, the body facts' constant SQL and the compiled querysets only.
    return f"SELECT {', '.join(column for _, column in fields)} FROM {tables}"  # noqa: S608


def connection_kwargs() -> dict[str, Any]:
    """psycopg's connection arguments from Django's settings (the same database and
    credentials, the same prepare_threshold: None, prepared statements off, makes the
    statements' `prepare=True` a no-op), autocommit, timestamps in UTC as Django's
    connections read them (a startup option; behind PgBouncer, which before 1.20 refuses
    `options`, a SET at connection instead: PgBouncer carries TimeZone to every server
    session it lends the connection)."""
    params = connections[DEFAULT_DB_ALIAS].get_connection_params()
    kwargs = {
        key: value for key, value in params.items() if key not in ("cursor_factory", "context")
    }
    if not settings.AIRLOCK_PGBOUNCER:
        kwargs["options"] = f"{kwargs.get('options', '')} -c TimeZone=UTC".strip()
    kwargs["autocommit"] = True
    # An unreachable server costs a poll no longer than Django's pool would make it wait.
    kwargs.setdefault("connect_timeout", settings.AIRLOCK_DB_POOL_TIMEOUT)
    return kwargs


class Connections:
    """At most `size` connections of this process, each with its cursor, handed out with
    no more than a list pop while one is idle (psycopg_pool's checkout cost as much as the
    304's own statement). A connection whose statement failed is closed, not reused: after
    a PostgreSQL restart the polls in flight go to Django, the next ones reconnect."""

    def __init__(self, kwargs: dict[str, Any], size: int) -> None:
        self.kwargs = kwargs
        self.idle: list[AsyncCursor[Any]] = []
        self.free = asyncio.Semaphore(size)
        self.timeout = float(settings.AIRLOCK_DB_POOL_TIMEOUT)

    async def rows(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if self.free.locked():
            await asyncio.wait_for(self.free.acquire(), self.timeout)
        else:
            await self.free.acquire()
        try:
            cursor = self.idle.pop() if self.idle else await self._connect()
            try:
                rows = await _prepared_rows(cursor, sql, params)
            except BaseException:
                await cursor.connection.close()
                raise
            self.idle.append(cursor)
            return rows
        finally:
            self.free.release()

    async def _connect(self) -> AsyncCursor[Any]:
        connection = await AsyncConnection.connect(**self.kwargs)
        set_json_loads(json_value, connection)
        if connection.info.parameter_status("TimeZone") != "UTC":
            await connection.execute("SET TIME ZONE 'UTC'", prepare=False)
        return connection.cursor()


# json's own C scanner, which json.loads calls after checking a text of unknown origin.
# (typeshed does not declare the attribute; json.decoder sets it in JSONDecoder.__init__.)
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def json_value(data: str | bytes) -> Any:
    """json.loads of a json or jsonb column's text, in a fifth of its time (4.7 -> 1.0 µs a
    small document here; a resource list's page loads one a row): PostgreSQL's text of a
    value starts with it, so the scanner parses it from the first character. Any other
    text (space before or after the value) is json.loads'; what either returns is the same."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    try:
        value, end = _scan_json(text, 0)
    except StopIteration:
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


async def _prepared_rows(
    cursor: AsyncCursor[Any], sql: str, params: tuple[Any, ...]
) -> list[tuple[Any, ...]]:
    """The statement's rows, run prepared. A plan a migration made stale (a column's type
    changed under the running process: console/stale_plans.py) is dropped with every other
    prepared statement of the connection and the statement runs once more: autocommit, so
    it is its own transaction and nothing else is lost."""
    try:
        await cursor.execute(sql, params, prepare=True)
    except psycopg.errors.FeatureNotSupported as error:
        if not is_stale_plan(error):
            raise
        logger.warning("a migration changed a fast poll statement's result: re-preparing")
        await cursor.connection.execute(DEALLOCATE_ALL, prepare=False)
        await cursor.execute(sql, params, prepare=True)
    return await cursor.fetchall()


def model_from_row(model: type[Model], fields: list[tuple[str, str]], values: Any) -> Any:
    return model.from_db(DEFAULT_DB_ALIAS, [name for name, _ in fields], list(values))
