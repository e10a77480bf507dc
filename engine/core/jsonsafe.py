"""The one JSON parser for everything Airlock reads from outside: API bodies,
the idempotency fingerprint, cursors and HTTP targets' responses.

The standard library's parser accepts things that are not JSON (`NaN`,
`Infinity`) or that PostgreSQL cannot store (lone UTF-16 surrogates, NUL,
numbers that overflow to infinity), lets duplicate keys silently override each
other, and recurses in C until a RecursionError. Here:

- not a JSON text (bad syntax, not UTF-8, a BOM, the `NaN`/`Infinity`/
  `-Infinity` literals) -> `JsonMalformed` (the API answers 400);
- a JSON text outside the limits below (nesting deeper than `MAX_DEPTH`, a key
  longer than `MAX_KEY_CHARS`, a string longer than `MAX_STRING_CHARS`, an
  integer of more than `MAX_INTEGER_DIGITS` digits, a number that is not a
  finite double, a lone surrogate escape, U+0000, a duplicate key) ->
  `JsonInvalid` (422, `errors: [{field, message}]` naming a JSON pointer).

Both are `validation_error` DomainErrors, so pages show the message and the API
answers problem+json. A leaf module: it imports nothing of the apps.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from engine.core.errors import DomainError

MAX_DEPTH = 64
MAX_KEY_CHARS = 256
MAX_STRING_CHARS = 65_536
MAX_INTEGER_DIGITS = 1_000

_SURROGATE = re.compile("[\ud800-\udfff]")


class JsonMalformed(DomainError):
    """Not a JSON text at all (400)."""

    code = "validation_error"
    status = 400


class JsonInvalid(DomainError):
    """A JSON text Airlock refuses to take in (422)."""

    code = "validation_error"
    status = 422


class _Refused(Exception):
    """Raised from inside the decoder's hooks; turned into JsonInvalid."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _invalid(message: str, *, field: str) -> JsonInvalid:
    return JsonInvalid(
        f"{field}: {message}", extra={"errors": [{"field": field, "message": message}]}
    )


def _refuse_constant(name: str) -> Any:
    raise _MalformedConstant(name)


class _MalformedConstant(Exception):
    pass


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is outside the range of a double")
    return value


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise _Refused(f"an integer has more than {MAX_INTEGER_DIGITS} digits")
    return int(text)


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _Refused(f"duplicate key {_shown(key[:40])!r}")
        result[key] = value
    return result


def _pointer_token(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _shown(pointer: str) -> str:
    """A JSON pointer safe to echo in an error: short, no surrogates, no NUL."""
    text = _SURROGATE.sub("\ufffd", pointer or "/").replace("\x00", "\ufffd")
    return text if len(text) <= 80 else text[:77] + "..."


def _check_string(value: str, *, pointer: str, what: str, limit: int) -> None:
    if len(value) > limit:
        raise _Refused(f"{what} at {_shown(pointer)} is longer than {limit} characters")
    if "\x00" in value:
        raise _Refused(f"{what} at {_shown(pointer)} contains U+0000")
    if _SURROGATE.search(value):
        raise _Refused(f"{what} at {_shown(pointer)} contains a lone surrogate escape")


def _check_tree(value: Any) -> None:
    """Walk the parsed value iteratively: depth, every key and every string."""
    stack: list[tuple[str, int, Any]] = [("", 0, value)]
    while stack:
        pointer, depth, item = stack.pop()
        if isinstance(item, str):
            _check_string(item, pointer=pointer, what="a string", limit=MAX_STRING_CHARS)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth >= MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            for key, child in item.items():
                child_pointer = f"{pointer}/{_pointer_token(key)}"
                _check_string(key, pointer=child_pointer, what="a key", limit=MAX_KEY_CHARS)
                stack.append((child_pointer, depth + 1, child))
        else:
            stack.extend(
                (f"{pointer}/{index}", depth + 1, child) for index, child in enumerate(item)
            )


def loads(data: bytes | str, *, field: str = "body") -> Any:
    """Parse one JSON text under the limits in the module docstring.

    Raises JsonMalformed (400) or JsonInvalid (422, naming `field`).
    """
    if isinstance(data, bytes | bytearray):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonMalformed(f"{field} is not UTF-8: {exc.reason}.") from None
    else:
        text = data
    try:
        value = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
            object_pairs_hook=_object_pairs,
        )
        _check_tree(value)
    except _MalformedConstant as exc:
        raise JsonMalformed(f"{field} is not valid JSON: {exc} is not a JSON number.") from None
    except _Refused as exc:
        raise _invalid(exc.message, field=field) from None
    except RecursionError:
        # The C decoder recurses once per level up to the interpreter's limit:
        # the tree walk refuses depth past MAX_DEPTH, this catches far past it.
        raise _invalid(f"nested deeper than {MAX_DEPTH} levels", field=field) from None
    except ValueError as exc:
        raise JsonMalformed(f"{field} is not valid JSON: {exc}") from None
    return value


def loads_or_none(data: bytes | str) -> Any:
    """For input Airlock only reads (an HTTP target's answer): None if refused."""
    try:
        return loads(data)
    except (JsonMalformed, JsonInvalid):
        return None
