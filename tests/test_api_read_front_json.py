"""The read front's loader of json and jsonb columns (approvals.api.fastpoll_sql.json_value)
returns what json.loads returns, for PostgreSQL's own texts of the values and for a json
column's text kept as written (space around the value)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from approvals.api.fastpoll_sql import json_value

pytestmark = pytest.mark.django_db

VALUES: list[Any] = [
    {},
    [],
    {"n": 0, "name": "asgi-cpu-007"},
    {"nested": {"list": [1, 2.5, -3e-7, None, True, False, "x"]}, "": ""},
    {"unicode": "çödé ✓ \u2028 \U0001f600", "escaped": 'quote " backslash \\ tab \t'},
    {"big": 123456789012345678901234567890, "precise": 0.1},
    "a string",
    42,
    None,
]


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("column_type", ["jsonb", "json"])
def test_a_columns_text_loads_as_json_loads_it(value: Any, column_type: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT (%s::{column_type})::text", [json.dumps(value)])
        (text,) = cursor.fetchone()
    assert json_value(text.encode()) == json.loads(text)
    assert json_value(text) == json.loads(text)


@pytest.mark.parametrize("text", [' {"a": 1}', '{"a": 1} ', "\n[1, 2]\t", "  7  "])
def test_a_json_text_with_space_around_it_loads_as_json_loads_it(text: str) -> None:
    """A json column keeps the text as written: json.loads takes any space around it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::json::text", [text])
        (stored,) = cursor.fetchone()
    assert stored == text
    assert json_value(stored.encode()) == json.loads(text)


@pytest.mark.parametrize("text", ["", "{", '{"a": 1} x', "[1,]"])
def test_a_text_that_is_not_json_is_refused_as_json_loads_refuses_it(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        json_value(text.encode())
