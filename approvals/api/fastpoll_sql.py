"""The poll front's database side (approvals/api/fastpoll.py): its two statements, built
from the models' metadata, and the few async psycopg connections it runs them on."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Model
from psycopg import AsyncConnection, AsyncCursor

from approvals.api.serialize import body_facts
from approvals.models import Action, Agent, Run
from console.stale_plans import DEALLOCATE_ALL, is_stale_plan

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


class Statements:
    """The two statements of a fast poll, built once from the models' metadata."""

    def __init__(self) -> None:
        run_table = Run._meta.db_table
        agent_table = Agent._meta.db_table
        action_table = Action._meta.db_table
        # The token's run: what the token check and run_token_action_scope read.
        self.token_fields = _fields(
            Run, "t", only=frozenset({"id", "agent_id", "token_hash", "status", "expires_at"})
        )
        # A run token whose agent is inactive is no credential (principal_for_token).
        token_from = (
            f'FROM "{run_table}" t JOIN "{agent_table}" g ON g.id = t.agent_id AND g.is_active '
        )
        where = "WHERE t.token_prefix = %s"
        # The 304 check: the action's revision and who may read it.
        self.state_fields = _fields(
            Action, "a", only=frozenset({"id", "run_id", "agent_id", "status", "revision"})
        )
        self.state_sql = (
            f"SELECT {', '.join(c for _, c in self.token_fields + self.state_fields)} "
            f'{token_from}LEFT JOIN "{action_table}" a ON a.id = %s {where}'
        )
        # The 200: the row and its run's (for the body) plus the body's facts. The facts'
        # SQL names the action table itself, so the action is not aliased here.
        quoted = f'"{action_table}"'
        self.action_fields = _fields(Action, quoted, exclude=frozenset({"payload"}))
        self.run_fields = _fields(Run, "ar", exclude=frozenset({"write_set", "task", "token_hash"}))
        self.agent_fields = [("id", "ag.id"), ("name", "ag.name")]
        facts = body_facts("postgresql")
        self.fact_names = [name for name, _ in facts]
        columns = (
            [c for _, c in self.token_fields + self.action_fields + self.run_fields]
            + [c for _, c in self.agent_fields]
            + [sql for _, sql in facts]
        )
        self.body_sql = (
            f"SELECT {', '.join(columns)} {token_from}"
            f"LEFT JOIN {quoted} ON {quoted}.id = %s "
            f'LEFT JOIN "{run_table}" ar ON ar.id = {quoted}.run_id '
            f'LEFT JOIN "{agent_table}" ag ON ag.id = ar.agent_id {where}'
        )


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
        if connection.info.parameter_status("TimeZone") != "UTC":
            await connection.execute("SET TIME ZONE 'UTC'", prepare=False)
        return connection.cursor()


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
