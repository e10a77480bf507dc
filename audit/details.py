"""What may enter an audit event's details: secret-looking keys and token-looking strings
redacted, and every value made to read back from PostgreSQL's jsonb exactly as it was hashed.
Pure functions, no I/O (audit/services.py calls `clean_details` for every event)."""

from __future__ import annotations

import functools
import json
import re
from decimal import Decimal
from typing import Any

# Keys whose values must never reach the audit trail.
_SECRET_KEY_PATTERN = re.compile(r"(token|secret|password|authorization|api[_-]?key)", re.I)
_TOKEN_VALUE_PATTERN = re.compile(r"\b(ak|rt|pt)_[A-Za-z0-9_-]{8,}")


def _scrub(value: Any) -> Any:
    """Drop secret-looking keys and token-looking strings from audit details."""
    if isinstance(value, dict):
        return {
            key: ("[redacted]" if _SECRET_KEY_PATTERN.search(str(key)) else _scrub(item))
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_scrub(item) for item in value]
    if isinstance(value, str):
        return _TOKEN_VALUE_PATTERN.sub("[redacted]", value)
    return value


def storable(value: Any) -> Any:
    """Make a JSON value read back from PostgreSQL jsonb exactly as hashed.

    jsonb has no NaN/Infinity and no NUL characters, rejects lone surrogates, and
    prints an integral number given in exponent form (1e+16) as an integer — each
    of those would make the stored row hash differently from the appended one.
    """
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [storable(item) for item in value]
    if isinstance(value, str):
        if value.isascii() and "\x00" not in value:  # the usual string: nothing to change
            return value
        return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value.is_integer() and "e" in repr(value):
            return int(Decimal(repr(value)))
    return value


def clean_details(details: dict[str, Any] | None) -> dict[str, Any]:
    cleaned: dict[str, Any]
    try:
        cleaned = _clean_plain(details or {})
    except _NotPlain:
        # Round-trip through JSON so the hash covers exactly what is stored.
        cleaned = storable(json.loads(json.dumps(_scrub(details or {}), default=str)))
    return cleaned


class _NotPlain(Exception):
    """A value the JSON round trip could change (a tuple, a float, a non-str key, ...)."""


_PLAIN_SCALARS = (int, bool, type(None))


def _clean_plain(value: Any) -> Any:
    """`clean_details` in one pass for details made only of dicts with str keys, lists,
    strs, ints, bools and None — what nearly every event carries, and what the JSON round
    trip leaves as it is: the same scrub, then the same `storable`, without the round trip.
    Anything else raises _NotPlain (the caller then takes the round trip)."""
    kind = type(value)
    if kind is dict:
        cleaned = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _NotPlain
            cleaned[storable(key)] = "[redacted]" if _secret_key(key) else _clean_plain(item)
        return cleaned
    if kind is list:
        return [_clean_plain(item) for item in value]
    if kind is str:
        return storable(_TOKEN_VALUE_PATTERN.sub("[redacted]", value) if "_" in value else value)
    if kind in _PLAIN_SCALARS:
        return value
    raise _NotPlain


@functools.lru_cache(maxsize=1024)
def _secret_key(key: str) -> bool:
    return _SECRET_KEY_PATTERN.search(key) is not None
