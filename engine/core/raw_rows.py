"""Model instances from raw SQL rows, as the ORM would build them.

The hot paths that send their own statements (the barrier's locks in
`engine/core/write_rows.py`, a decision's in `approvals/services/decision_rows.py`) select a
model's columns by name and turn the row back into instances here: the column list and the
per-field conversions (a JSONField decodes its text) are worked out once per model and
column set, not per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connection
from django.db.models import Field, Model

if TYPE_CHECKING:
    Column = Field[Any, Any]
else:
    Column = Field

_M = TypeVar("_M", bound=Model)


@cache
def model_columns(model: type[Model], only: frozenset[str] | None = None) -> tuple[Column, ...]:
    """The model's concrete fields in declaration order (`only`: those attnames)."""
    return tuple(
        field
        for field in model._meta.concrete_fields
        if isinstance(field, Field) and (only is None or field.attname in only)
    )


def select_list(columns: Sequence[Column], alias: str) -> str:
    """`alias."column", …` for a SELECT."""
    return ", ".join(f'{alias}."{field.column}"' for field in columns)


def from_row(
    model: type[_M], columns: tuple[Column, ...], row: Sequence[Any], offset: int = 0
) -> _M:
    """An instance from `row[offset:]` holding `columns` in that order; columns not given
    are deferred, as with the ORM's `only()`."""
    names, conversions = _loader(columns)
    values = list(row[offset : offset + len(names)])
    for index, field, convert in conversions:
        values[index] = convert(values[index], field, connection)
    return model.from_db(connection.alias, names, values)


@cache
def _loader(columns: tuple[Column, ...]) -> tuple[list[str], tuple[tuple[int, Column, Any], ...]]:
    """The attribute names, and (index, field, converter) of each field the ORM converts
    after reading it."""
    conversions = tuple(
        (index, field, convert)
        for index, field in enumerate(columns)
        for convert in field.get_db_converters(connection)
    )
    return [field.attname for field in columns], conversions
