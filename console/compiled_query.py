"""ORM querysets built and compiled once per process, then run with new parameters.

A profile of a write proposal under load (issue 41: `py-spy record --gil` over
`bench.proposal_cpu`) put most of the web process's CPU in Django building and compiling
the same few querysets on every request: `filter()` → `add_q`, `get_order_by`, `as_sql`,
expression hashing — about 1.8 ms for the write-set check's one statement, run twice a
proposal, against ~0.2 ms to send it and read its rows. The statement's text never changes
between requests; only its values do.

`CompiledQuery` keeps the ORM as the one way a statement is written (the model's columns,
joins, annotations, converters, SQLite and PostgreSQL alike) and skips the rebuilding: the
queryset is written once with `Param("name", field)` where a request's value goes, compiled
on first use for each database vendor, and each call executes the compiled text with the
values put in place (each prepared by its field, as the ORM would) and turns rows into model
instances exactly as Django's `ModelIterable` does (select_related, annotations,
converters). Statement capture (`CaptureQueriesContext`), the debug cursor and the
project's server-binding cursor see the same statements as before.

Limits, refused at compile time rather than silently mishandled: no prefetch_related, no
known related objects (a queryset from a related manager), and every `Param` must appear in
the compiled parameters.

`CompiledInsert` is the same for a model's INSERT: `Model.save()` of a new row built the
statement anew each time (`SQLInsertCompiler.as_sql`, the fields' placeholders, the
returning clause: a fifth of a write proposal's request thread, two INSERTs a proposal).
Its text is built once a process per vendor; each call prepares the row's values as
`save()` does (`pre_save`, `get_db_prep_save`), sends the pre_save/post_save signals where
anyone listens, sets what the database returned (the id) and the instance's state. It can
also skip a row that breaks a unique constraint (`ON CONFLICT DO NOTHING`): one statement,
no savepoint and no IntegrityError, for a claim that two requests may race for. Its
`insert_many` is `bulk_create` the same way (a statement compiled for each row count up to
a chunk): the worker's operations and history rows, a batch at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import connection, transaction
from django.db.models import Expression, Field, Model, QuerySet, signals
from django.db.models import query as django_query
from django.db.models.constants import OnConflict
from django.db.models.query import ModelIterable, ValuesListIterable
from django.db.models.sql import InsertQuery
from django.db.models.sql.compiler import SQLCompiler
from django.db.transaction import TransactionManagementError

_M = TypeVar("_M", bound=Model)


class Param(Expression):
    """Where a call's value goes in a compiled queryset: compiles to one placeholder whose
    parameter is this object, replaced at each call by the value prepared by `field`."""

    def __init__(self, name: str, field: Field[Any, Any]) -> None:
        super().__init__(output_field=field)
        self.name = name

    def as_sql(self, compiler: Any, connection: Any) -> Any:
        return "%s", [self]

    def __repr__(self) -> str:
        return f"Param({self.name!r})"

    # Expressions are compared and hashed by their constructor arguments; two Params of one
    # name are the same parameter.
    @property
    def identity(self) -> tuple[Any, ...]:
        return (Param, self.name)


@dataclass(frozen=True)
class _Compiled:
    sql: str
    params: tuple[Any, ...]  # literal values, and Param objects where a call's value goes
    compiler: SQLCompiler
    values_list: bool
    locks: bool  # select_for_update: only inside a transaction, as the ORM checks
    # What SQLCompiler.results_iter works out again at every call: the columns' converters
    # (about a fifth of a compiled read's own CPU), and whether a column is composite.
    converters: dict[int, Any]
    composite: bool

    def converted(self, rows: list[Any]) -> Any:
        """The rows as results_iter gives them: each column through its converters."""
        converted: Any = rows
        if self.converters:
            converted = self.compiler.apply_converters(converted, self.converters)
        if self.composite:
            fields = _selected(self.compiler)
            converted = self.compiler.composite_fields_to_tuples(converted, fields)
        return converted


class CompiledQuery:
    """`build()` returns the queryset, with `Param`s for what changes between calls."""

    def __init__(self, build: Callable[[], QuerySet[Any, Any]]) -> None:
        self._build = build
        self._by_vendor: dict[str, _Compiled] = {}

    def all(self, **values: Any) -> list[Any]:
        """Model instances (or row tuples, for a `values_list()` queryset)."""
        compiled = self._compiled()
        rows = compiled.converted(self._execute(compiled, values))
        if compiled.values_list:
            return [tuple(row) for row in rows]
        return list(_instances(compiled.compiler, rows))

    def first(self, **values: Any) -> Any | None:
        """The first row the statement returns, as compiled: unlike `QuerySet.first()` no
        order or LIMIT is added, so use it where at most one row can match (a key) or give
        the queryset its own `order_by()` and slice."""
        found = self.all(**values)
        return found[0] if found else None

    def get(self, **values: Any) -> Any:
        found = self.all(**values)
        if len(found) != 1:
            model: Any = self._compiled().compiler.query.model
            if not found:
                raise model.DoesNotExist(f"{model.__name__} matching {values} does not exist.")
            raise model.MultipleObjectsReturned(f"{len(found)} {model.__name__} for {values}")
        return found[0]

    def _compiled(self) -> _Compiled:
        vendor = connection.vendor
        compiled = self._by_vendor.get(vendor)
        if compiled is None:
            compiled = self._by_vendor[vendor] = _compile(self._build())
        return compiled

    @staticmethod
    def _execute(compiled: _Compiled, values: dict[str, Any]) -> list[Any]:
        if compiled.locks and connection.get_autocommit():
            # The ORM refuses this when it compiles; a compiled statement is compiled once.
            raise TransactionManagementError(
                "select_for_update cannot be used outside of a transaction."
            )
        params = [_value(param, values) for param in compiled.params]
        with connection.cursor() as cursor:
            cursor.execute(compiled.sql, params)
            return list(cursor.fetchall())


def _value(param: Any, values: dict[str, Any]) -> Any:
    if not isinstance(param, Param):
        return param
    try:
        value = values[param.name]
    except KeyError:
        raise TypeError(f"no value given for Param({param.name!r})") from None
    return param.output_field.get_db_prep_value(value, connection, prepared=False)


def _compile(built: QuerySet[Any, Any]) -> _Compiled:
    queryset: Any = built  # its private attributes are read: not in the stubs
    if queryset._prefetch_related_lookups:
        raise TypeError("CompiledQuery does not prefetch: load related rows another way")
    if queryset._known_related_objects:
        raise TypeError("CompiledQuery takes a queryset from a model's manager, not a related one")
    values_list = queryset._iterable_class is ValuesListIterable
    if not (values_list or queryset._iterable_class is ModelIterable):
        raise TypeError("CompiledQuery runs model and values_list() querysets only")
    if values_list and (queryset._fields is None or queryset.query.annotation_select):
        raise TypeError("CompiledQuery's values_list() names plain columns only")
    compiler = queryset.query.get_compiler(using=queryset.db)
    sql, params = compiler.as_sql()
    if not any(isinstance(param, Param) for param in params):
        raise TypeError("a CompiledQuery without a Param is a constant: cache its result instead")
    fields = _selected(compiler)
    return _Compiled(
        sql,
        tuple(params),
        compiler,
        values_list,
        locks=bool(queryset.query.select_for_update),
        converters=compiler.get_converters(fields),
        composite=compiler.has_composite_fields(fields),
    )


def _selected(compiler: SQLCompiler) -> list[Any]:
    """The selected expressions, as results_iter reads them (after as_sql)."""
    return [column[0] for column in compiler.select[0 : compiler.col_count]]


def _instances(compiler: SQLCompiler, rows: Any) -> Any:
    """`ModelIterable.__iter__` over rows already fetched and converted (Django 5.2's, less
    the known related objects that `_compile` refuses)."""
    select, klass_info, annotation_col_map = (
        compiler.select,
        compiler.klass_info,
        compiler.annotation_col_map,
    )
    assert klass_info is not None
    model_cls = klass_info["model"]
    select_fields = klass_info["select_fields"]
    start, end = select_fields[0], select_fields[-1] + 1
    init_list = [column[0].target.attname for column in select[start:end]]
    db = compiler.using
    related_populators = django_query.get_related_populators(klass_info, select, db)  # type: ignore[call-arg,arg-type]
    for row in rows:
        obj = model_cls.from_db(db, init_list, row[start:end])
        for populator in related_populators:
            populator.populate(row, obj)
        if annotation_col_map:
            for attr_name, position in annotation_col_map.items():
                setattr(obj, attr_name, row[position])
        yield obj


@dataclass(frozen=True)
class _CompiledInsert:
    sql: str
    fields: tuple[Any, ...]  # the columns written, in the statement's order
    returning: tuple[Any, ...]  # the fields the database fills in (the auto id)
    converters: dict[int, Any]
    compiler: SQLCompiler


class CompiledInsert:
    """`insert(obj)`: `obj.save(force_insert=True)` for a new row of `model` (no parents, no
    explicit auto id), with the statement compiled once. `skip_conflicts`: a row that
    breaks a unique constraint is not inserted and `insert` returns False (the instance
    stays unsaved) instead of raising IntegrityError. `insert_many(objs)`: `bulk_create`
    of new rows (no signals, as bulk_create sends none), one statement a chunk."""

    # Rows a statement at the most (a statement is compiled for each count up to it).
    CHUNK = 32

    def __init__(self, model: type[Model], *, skip_conflicts: bool = False) -> None:
        meta = model._meta
        if meta.parents:
            raise TypeError("CompiledInsert writes one table: not a model with parents")
        self.model = model
        self.skip_conflicts = skip_conflicts
        self._compiled: dict[tuple[str, int], _CompiledInsert] = {}

    def insert(self, obj: Model) -> bool:
        self._check(obj)
        alias = connection.alias
        if signals.pre_save.has_listeners(self.model):
            signals.pre_save.send(
                sender=self.model, instance=obj, raw=False, using=alias, update_fields=None
            )
        if not self._insert_chunk([obj]):
            return False
        if signals.post_save.has_listeners(self.model):
            signals.post_save.send(
                sender=self.model,
                instance=obj,
                created=True,
                update_fields=None,
                raw=False,
                using=alias,
            )
        return True

    def insert_many(self, objs: Iterable[_M]) -> list[_M]:
        """The new rows, inserted in order (each given what the database returned); with
        skip_conflicts, refused: which rows were skipped would be unknown."""
        if self.skip_conflicts:
            raise TypeError("insert_many does not skip conflicts: insert each row instead")
        rows = list(objs)
        for obj in rows:
            self._check(obj)
        for start in range(0, len(rows), self.CHUNK):
            self._insert_chunk(rows[start : start + self.CHUNK])
        return rows

    def _check(self, obj: Model) -> None:
        if type(obj) is not self.model:
            raise TypeError(f"CompiledInsert({self.model.__name__}) got {type(obj).__name__}")
        meta = self.model._meta
        pk: Any = meta.pk
        if meta.auto_field is None and obj.pk is None:
            setattr(obj, pk.attname, pk.get_pk_value_on_save(obj))
        elif meta.auto_field is not None and obj.pk is not None:
            raise TypeError("CompiledInsert lets the database number the row: no id given")

    def _insert_chunk(self, objs: Sequence[Model]) -> bool:
        """Insert `objs` (at most CHUNK) in one statement; False if a conflict skipped it."""
        compiled = self._statement(len(objs))
        params = [
            _insert_value(field, obj, compiled.compiler)
            for obj in objs
            for field in compiled.fields
        ]
        alias = connection.alias
        with (
            transaction.mark_for_rollback_on_error(using=alias),
            connection.cursor() as cursor,
        ):
            cursor.execute(compiled.sql, params)
            # A row a row inserted: what the database returned, or nothing to set.
            returned: Any = cursor.fetchall() if compiled.returning else [()] * cursor.rowcount
        if len(returned) != len(objs):  # a conflict skipped the row
            return False
        if compiled.converters:
            returned = list(compiled.compiler.apply_converters(returned, compiled.converters))
        # The rows come back in the VALUES' order (bulk_create relies on it as well).
        for obj, row in zip(objs, returned, strict=True):
            for value, field in zip(row, compiled.returning, strict=True):
                setattr(obj, field.attname, value)
            obj._state.adding = False
            obj._state.db = alias
        return True

    def _statement(self, rows: int) -> _CompiledInsert:
        key = (connection.vendor, rows)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._compile(rows)
        return compiled

    def _compile(self, rows: int) -> _CompiledInsert:
        meta = self.model._meta
        # Model._save_table's columns for a new row: the auto id is the database's.
        fields = tuple(
            f for f in meta.local_concrete_fields if not f.generated and f is not meta.auto_field
        )
        ops: Any = connection.ops
        features = connection.features
        on_conflict = OnConflict.IGNORE if self.skip_conflicts else None
        returning = tuple(meta.db_returning_fields)
        if returning and not features.can_return_columns_from_insert:
            raise TypeError(f"{connection.vendor} cannot return the inserted row's columns")
        if returning and rows > 1 and not features.can_return_rows_from_bulk_insert:
            raise TypeError(f"{connection.vendor} cannot return the inserted rows' columns")
        row = f"({', '.join(['%s'] * len(fields))})"
        parts = [
            f"{ops.insert_statement(on_conflict=on_conflict)} {ops.quote_name(meta.db_table)}",
            f"({', '.join(ops.quote_name(f.column) for f in fields)})",
            f"VALUES {', '.join([row] * rows)}",
        ]
        suffix = ops.on_conflict_suffix_sql(fields, on_conflict, (), ())
        if suffix:
            parts.append(suffix)
        if returning:
            returning_sql, returning_params = ops.return_insert_columns(returning)
            if returning_params:
                raise TypeError("CompiledInsert reads returned columns from the row only")
            parts.append(returning_sql)
        compiler: Any = InsertQuery(self.model).get_compiler(connection=connection)
        columns = [field.get_col(meta.db_table) for field in returning]
        return _CompiledInsert(
            sql=" ".join(parts),
            fields=fields,
            returning=returning,
            converters=compiler.get_converters(columns),
            compiler=compiler,
        )


def _insert_value(field: Any, obj: Model, compiler: SQLCompiler) -> Any:
    """What SQLInsertCompiler sends for `field` of a new row (pre_save_val, prepare_value)."""
    return _saved_value(field, field.pre_save(obj, True), compiler, "CompiledInsert")


def _saved_value(field: Any, value: Any, compiler: Any, statement: str) -> Any:
    """`value` as the ORM sends it to be stored in `field` (get_db_prep_save), where its
    placeholder is the plain %s the compiled text has."""
    if hasattr(value, "resolve_expression"):
        raise TypeError(f"{statement} sends values, not expressions ({field.name})")
    prepared = field.get_db_prep_save(value, connection=connection)
    # A field may wrap its value's placeholder (a BinaryField on MySQL: `_binary %s`).
    wrapped = hasattr(field, "get_placeholder")
    if wrapped and field.get_placeholder(prepared, compiler, connection) != "%s":
        raise TypeError(f"{statement} writes plain %s placeholders only ({field.name})")
    return prepared


class CompiledUpdate:
    """`model.objects.filter(<where> = …).update(<columns> = …)` with the column names fixed
    and the statement built once a process: `update(columns={…}, where={…})` → rows
    changed. Equality on plain values only (a None in `where` is refused: SQL's `= NULL`
    matches nothing), values prepared by their fields as QuerySet.update does."""

    def __init__(self, model: type[Model], *, columns: Sequence[str], where: Sequence[str]) -> None:
        meta = model._meta
        self.model = model
        self._set: tuple[Any, ...] = tuple(meta.get_field(name) for name in columns)
        self._where: tuple[Any, ...] = tuple(meta.get_field(name) for name in where)
        if not self._set or not self._where:
            raise TypeError("CompiledUpdate sets at least one column, where at least one holds")
        if any(not getattr(f, "concrete", False) for f in (*self._set, *self._where)):
            raise TypeError("CompiledUpdate names the model's own columns only")
        self._names = (tuple(columns), tuple(where))
        self._sql: dict[str, str] = {}

    def update(self, *, columns: dict[str, Any], where: dict[str, Any]) -> int:
        if (tuple(columns), tuple(where)) != self._names:
            raise TypeError(f"CompiledUpdate was compiled for {self._names}")
        params = [
            _saved_value(field, value, None, "CompiledUpdate")
            for field, value in zip(self._set, columns.values(), strict=True)
        ]
        for field, value in zip(self._where, where.values(), strict=True):
            if value is None or hasattr(value, "resolve_expression"):
                raise TypeError(
                    f"CompiledUpdate matches plain values, not None or expressions ({field.name})"
                )
            params.append(field.get_db_prep_value(value, connection, prepared=False))
        with (
            transaction.mark_for_rollback_on_error(using=connection.alias),
            connection.cursor() as cursor,
        ):
            cursor.execute(self._statement(), params)
            return int(cursor.rowcount)

    def _statement(self) -> str:
        sql = self._sql.get(connection.vendor)
        if sql is None:
            qn: Any = connection.ops.quote_name
            assignments = ", ".join(f"{qn(f.column)} = %s" for f in self._set)
            conditions = " AND ".join(f"{qn(f.column)} = %s" for f in self._where)
            table = qn(self.model._meta.db_table)
            sql = f"UPDATE {table} SET {assignments} WHERE {conditions}"  # noqa: S608 - names
            self._sql[connection.vendor] = sql
        return sql
