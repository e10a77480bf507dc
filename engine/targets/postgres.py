"""PostgreSQL table rows as a target (psycopg 3): one row per resource, found by its key.

A kind's settings (validated by `PostgresSettings.from_settings`, which refuses bad ones
with a message naming the setting):

    credentials_env   the environment variable holding the connection string (read by the
                      worker at each call; never stored, scrubbed from every message)
    schema            optional schema of the table
    table             the table
    key_column        the column holding the resource's name (needs a unique index for create)
    document_column   one jsonb column holding the whole document, or
    columns           {"field": "column", ...}: the document is an object of these fields
    version_column    an integer or text column the adapter advances on each write; omitted →
                      the row's `xmin` (PostgreSQL's own row version; see below)
    version_type      "integer" (version + 1) or "text" (a fresh random uuid); default integer
    fence_column      optional bigint column: a write also needs `fence < :fence` and sets it
    connect_timeout   seconds (default 5); lock_timeout seconds (default 2);
    statement_timeout seconds (default 30): a statement cancelled by either is rolled back,
                      so it is `locked` (back off), never unknown

A write is ONE statement: `UPDATE … WHERE key = %s AND version::text = %s [AND fence < %s]
RETURNING version::text`; a create is `INSERT … ON CONFLICT (key) DO NOTHING`; a delete is a
conditional `DELETE`. Zero rows → the row is read again to tell stale (with the current
document) from fenced from missing. Identifiers are checked against a strict pattern and
quoted with `psycopg.sql.Identifier`; every value is a bound parameter.

`xmin` as the version: it changes on every update and is compared as text, but it is the
transaction id, so two writes in one transaction share it (the adapter makes one per
transaction) and after about four billion transactions an id can come back (wraparound);
a table Airlock governs for long should have its own version column.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from engine.targets.base import (
    ABSENT,
    Capabilities,
    Outcome,
    RestoresByVerbs,
    Snapshot,
    TargetConfigError,
    TargetError,
    WriteResult,
    check_env_name,
    read_credentials,
    refuse_unknown_settings,
    scrub,
)
from engine.targets.pg_pool import pooled_connection

# Lower-case SQL identifiers only: no quoting games, no case surprises, at most 63 bytes.
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
_KNOWN = (
    "credentials_env",
    "schema",
    "table",
    "key_column",
    "document_column",
    "columns",
    "version_column",
    "version_type",
    "fence_column",
    "connect_timeout",
    "lock_timeout",
    "statement_timeout",
)
# SQLSTATE classes after which the statement is known to have been rolled back and may be
# retried later: lock not available, serialization/deadlock, canceled by a timeout.
_BUSY_STATES = frozenset({"55P03", "40001", "40P01", "57014"})


def _identifier(value: Any, setting: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise TargetConfigError(
            f"{setting}: {value!r} is not a plain lower-case SQL identifier "
            "([a-z_][a-z0-9_]*, at most 63 characters)"
        )
    return value


def _seconds(value: Any, setting: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 300:
        raise TargetConfigError(f"{setting}: a number of seconds between 0 and 300")
    return float(value)


@dataclass(frozen=True)
class PostgresSettings:
    credentials_env: str
    table: str
    key_column: str
    schema: str | None = None
    document_column: str | None = None
    columns: tuple[tuple[str, str], ...] = ()  # (field, column)
    version_column: str | None = None  # None → xmin
    version_type: str = "integer"
    fence_column: str | None = None
    connect_timeout: float = 5.0
    lock_timeout: float = 2.0
    statement_timeout: float = 30.0

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> PostgresSettings:
        """The kind's settings, checked; a `TargetConfigError` says what is wrong."""
        if not isinstance(settings, Mapping):
            raise TargetConfigError("settings: an object")
        refuse_unknown_settings(settings, _KNOWN)
        document_column = settings.get("document_column")
        columns_setting = settings.get("columns")
        if (document_column is None) == (columns_setting is None):
            raise TargetConfigError(
                "give exactly one of document_column (one jsonb column) or columns "
                "(a map of document fields to columns)"
            )
        columns: tuple[tuple[str, str], ...] = ()
        if columns_setting is not None:
            if not isinstance(columns_setting, Mapping) or not columns_setting:
                raise TargetConfigError("columns: a non-empty map of field → column")
            for field, column in columns_setting.items():
                if not isinstance(field, str) or not _FIELD.match(field):
                    raise TargetConfigError(f"columns: {field!r} is not a valid field name")
                columns += ((field, _identifier(column, f"columns.{field}")),)
        version_type = settings.get("version_type", "integer")
        if version_type not in ("integer", "text"):
            raise TargetConfigError('version_type: "integer" or "text"')
        schema = settings.get("schema")
        version_column = settings.get("version_column")
        fence_column = settings.get("fence_column")
        made = cls(
            credentials_env=check_env_name(settings.get("credentials_env")),
            table=_identifier(settings.get("table"), "table"),
            key_column=_identifier(settings.get("key_column"), "key_column"),
            schema=None if schema is None else _identifier(schema, "schema"),
            document_column=(
                None if document_column is None else _identifier(document_column, "document_column")
            ),
            columns=columns,
            version_column=(
                None if version_column is None else _identifier(version_column, "version_column")
            ),
            version_type=version_type,
            fence_column=None
            if fence_column is None
            else _identifier(fence_column, "fence_column"),
            connect_timeout=_seconds(settings.get("connect_timeout"), "connect_timeout", 5.0),
            lock_timeout=_seconds(settings.get("lock_timeout"), "lock_timeout", 2.0),
            statement_timeout=_seconds(
                settings.get("statement_timeout"), "statement_timeout", 30.0
            ),
        )
        used = [made.key_column, made.version_column, made.fence_column, made.document_column]
        used += [column for _, column in columns]
        named = [column for column in used if column is not None]
        if len(named) != len(set(named)):
            raise TargetConfigError("key, version, fence and document columns must all differ")
        if "xmin" in named:
            raise TargetConfigError("xmin is the default version: leave version_column out")
        return made


def _scrubbed(exc: Exception, secrets: list[str]) -> str:
    """The error's text with the connection string and its password taken out."""
    return scrub(f"{type(exc).__name__}: {exc}", secrets)


def _secrets_of(dsn: str) -> list[str]:
    """The connection string and the password in it (as written and percent-decoded)."""
    found = [dsn]
    for pattern in (r"://[^:/@\s]*:([^@]*)@", r"password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)"):
        for match in re.finditer(pattern, dsn):
            found += [match.group(1), match.group(1).strip("'"), unquote(match.group(1))]
    return found


class PostgresTarget(RestoresByVerbs):
    """One kind's table. Each call is one statement on an autocommit connection (one
    statement is one transaction), kept between calls by engine/targets/pg_pool.py."""

    def __init__(self, settings: PostgresSettings) -> None:
        self.settings = settings

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            holds_fence=self.settings.fence_column is not None, takes_idempotency_key=False
        )

    # -- SQL pieces --------------------------------------------------------------------------

    def _table(self) -> sql.Identifier:
        s = self.settings
        return sql.Identifier(s.schema, s.table) if s.schema else sql.Identifier(s.table)

    def _version(self) -> sql.Composable:
        column = self.settings.version_column
        return sql.SQL("{}::text").format(sql.Identifier(column or "xmin"))

    def _document_select(self) -> sql.Composable:
        s = self.settings
        if s.document_column:
            return sql.Identifier(s.document_column)
        # to_jsonb keeps each column's value JSON (numbers, text, timestamps as strings).
        return sql.SQL(", ").join(
            sql.SQL("to_jsonb({})").format(sql.Identifier(column)) for _, column in s.columns
        )

    def _document_values(self, document: Any) -> tuple[list[sql.Composable], list[Any]]:
        """The document's columns and their values (bound), or TargetError when the
        document does not fit the mapping."""
        s = self.settings
        try:
            json.dumps(document, allow_nan=False)
        except (TypeError, ValueError):
            raise TargetError("the document is not JSON") from None
        if s.document_column:
            return [sql.Identifier(s.document_column)], [Jsonb(document)]
        if not isinstance(document, dict):
            raise TargetError("the document must be an object of the mapped fields")
        unmapped = sorted(set(document) - {field for field, _ in s.columns})
        if unmapped:
            raise TargetError(f"fields with no column: {', '.join(unmapped)}")
        # jsonb_populate_record converts each JSON value with the column's own input rules.
        record = {column: document.get(field) for field, column in s.columns}
        names = [sql.Identifier(column) for _, column in s.columns]
        populate = sql.SQL("(SELECT {} FROM jsonb_populate_record(NULL::{}, %s))").format(
            sql.SQL(", ").join(names), self._table()
        )
        return [sql.SQL("({})").format(sql.SQL(", ").join(names))], [populate, Jsonb(record)]

    def _next_version(self) -> sql.Composable:
        s = self.settings
        assert s.version_column is not None
        if s.version_type == "integer":
            return sql.SQL("{} + 1").format(sql.Identifier(s.version_column))
        return sql.SQL("gen_random_uuid()::text")

    # -- connection -----------------------------------------------------------------------

    def _run(self, query: sql.Composed, params: list[Any]) -> tuple[Any, WriteResult | None]:
        """One statement's rows, or the WriteResult that says why there are none. The
        connection comes from this process's pool for the kind's connection string
        (engine/targets/pg_pool.py)."""
        s = self.settings
        try:
            dsn = read_credentials(s.credentials_env)
        except TargetError as exc:
            return None, WriteResult(Outcome.NOT_SENT, detail=str(exc))
        secrets = _secrets_of(dsn)
        options = (
            f"-c lock_timeout={int(s.lock_timeout * 1000)} "
            f"-c statement_timeout={int(s.statement_timeout * 1000)}"
        )
        sent = False
        try:
            with pooled_connection(
                dsn, connect_timeout=max(1, int(s.connect_timeout)), options=options
            ) as connection:
                sent = True
                rows = connection.execute(query, params).fetchall()
        except Exception as exc:  # the text may hold the DSN: kept only once scrubbed
            if not sent:  # no connection could be made: nothing reached the target
                return None, WriteResult(Outcome.NOT_SENT, detail=_scrubbed(exc, secrets))
            if not isinstance(exc, psycopg.Error):
                raise
            return None, self._classify(exc, secrets)
        return rows, None

    @staticmethod
    def _classify(exc: psycopg.Error, secrets: list[str]) -> WriteResult:
        detail = _scrubbed(exc, secrets)
        if exc.sqlstate in _BUSY_STATES:
            return WriteResult(Outcome.LOCKED, detail=detail)
        if isinstance(exc, psycopg.OperationalError):
            # The connection broke with the statement sent: it may have committed.
            return WriteResult(Outcome.UNKNOWN, detail=detail)
        return WriteResult(Outcome.FAILED, detail=detail)

    # -- the interface -------------------------------------------------------------------------

    def read(self, name: str) -> Snapshot:
        s = self.settings
        query = sql.SQL("SELECT {}, {} FROM {} WHERE {} = %s").format(
            self._version(), self._document_select(), self._table(), sql.Identifier(s.key_column)
        )
        rows, failure = self._run(query, [name])
        if failure is not None:
            raise TargetError(f"cannot read {s.table}: {failure.detail}")
        return self._snapshot(rows)

    def _snapshot(self, rows: list[Any]) -> Snapshot:
        if not rows:
            return ABSENT
        row = rows[0]
        if self.settings.document_column:
            return Snapshot(row[1], row[0])
        fields = [field for field, _ in self.settings.columns]
        return Snapshot(dict(zip(fields, row[1:], strict=True)), row[0])

    def _fence_row(self, name: str) -> tuple[Snapshot | None, int | None]:
        """The row and its fence; (None, None) when it cannot be read right now."""
        s = self.settings
        fence = sql.Identifier(s.fence_column) if s.fence_column else sql.SQL("NULL::bigint")
        query = sql.SQL("SELECT {}, {}, {} FROM {} WHERE {} = %s").format(
            self._version(),
            self._document_select(),
            fence,
            self._table(),
            sql.Identifier(s.key_column),
        )
        rows, failure = self._run(query, [name])
        if failure is not None:
            return None, None
        if not rows:
            return ABSENT, None
        return self._snapshot([rows[0][:-1]]), rows[0][-1]

    def _refused(self, name: str, expected_version: str, fence: int) -> WriteResult:
        """Zero rows changed: stale (with the current row), fenced, or missing."""
        current, current_fence = self._fence_row(name)
        if (
            current is not None
            and current.version == expected_version
            and current_fence is not None
            and current_fence >= fence
        ):
            return WriteResult(
                Outcome.FENCED, current=current, detail=f"fence {current_fence} >= {fence}"
            )
        return WriteResult(Outcome.STALE, current=current)

    def _conditions(self, name: str, expected_version: str, fence: int) -> tuple[Any, list[Any]]:
        s = self.settings
        parts = [
            sql.SQL("{} = %s").format(sql.Identifier(s.key_column)),
            sql.SQL("{} = %s").format(self._version()),
        ]
        params: list[Any] = [name, expected_version]
        if s.fence_column:
            parts.append(
                sql.SQL("({0} IS NULL OR {0} < %s)").format(sql.Identifier(s.fence_column))
            )
            params.append(fence)
        return sql.SQL(" AND ").join(parts), params

    def write(
        self,
        name: str,
        document: Any,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        s = self.settings
        try:
            columns, values = self._document_values(document)
        except TargetError as exc:
            return WriteResult(Outcome.FAILED, detail=str(exc))
        assignments: list[sql.Composable] = []
        params: list[Any] = []
        if s.document_column:
            assignments.append(sql.SQL("{} = %s").format(columns[0]))
            params.append(values[0])
        else:
            assignments.append(sql.SQL("{} = {}").format(columns[0], values[0]))
            params.append(values[1])
        if s.version_column:
            assignments.append(
                sql.SQL("{} = {}").format(sql.Identifier(s.version_column), self._next_version())
            )
        if s.fence_column:
            assignments.append(sql.SQL("{} = %s").format(sql.Identifier(s.fence_column)))
            params.append(fence)
        where, where_params = self._conditions(name, expected_version, fence)
        query = sql.SQL("UPDATE {} SET {} WHERE {} RETURNING {}").format(
            self._table(), sql.SQL(", ").join(assignments), where, self._version()
        )
        rows, failure = self._run(query, params + where_params)
        if failure is not None:
            return failure
        if rows:
            return WriteResult(Outcome.APPLIED, version=rows[0][0])
        return self._refused(name, expected_version, fence)

    def create(
        self,
        name: str,
        document: Any,
        *,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        s = self.settings
        try:
            columns, values = self._document_values(document)
        except TargetError as exc:
            return WriteResult(Outcome.FAILED, detail=str(exc))
        names: list[sql.Composable] = [sql.Identifier(s.key_column)]
        placeholders: list[sql.Composable] = [sql.SQL("%s")]
        params: list[Any] = [name]
        if s.document_column:
            names.append(columns[0])
            placeholders.append(sql.SQL("%s"))
            params.append(values[0])
        else:
            names += [sql.Identifier(column) for _, column in s.columns]
            placeholders += [
                sql.SQL("(jsonb_populate_record(NULL::{}, %s)).{}").format(
                    self._table(), sql.Identifier(column)
                )
                for _, column in s.columns
            ]
            params += [values[1]] * len(s.columns)
        if s.version_column:
            names.append(sql.Identifier(s.version_column))
            placeholders.append(sql.SQL("%s"))
            params.append(1 if s.version_type == "integer" else str(uuid.uuid4()))
        if s.fence_column:
            names.append(sql.Identifier(s.fence_column))
            placeholders.append(sql.SQL("%s"))
            params.append(fence)
        query = sql.SQL(
            "INSERT INTO {} ({}) VALUES ({}) ON CONFLICT ({}) DO NOTHING RETURNING {}"
        ).format(
            self._table(),
            sql.SQL(", ").join(names),
            sql.SQL(", ").join(placeholders),
            sql.Identifier(s.key_column),
            self._version(),
        )
        rows, failure = self._run(query, params)
        if failure is not None:
            return failure
        if rows:
            return WriteResult(Outcome.APPLIED, version=rows[0][0])
        return WriteResult(Outcome.STALE, current=self._fence_row(name)[0], detail="exists")

    def delete(
        self,
        name: str,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        where, params = self._conditions(name, expected_version, fence)
        query = sql.SQL("DELETE FROM {} WHERE {} RETURNING 1").format(self._table(), where)
        rows, failure = self._run(query, params)
        if failure is not None:
            return failure
        if rows:
            return WriteResult(Outcome.APPLIED, version=None)
        return self._refused(name, expected_version, fence)
