"""The current request id, carried in a context variable.

Services record it in every audit event without it being threaded through
every call; jobs set it from the action they execute.
"""

from __future__ import annotations

import contextvars
import re
import uuid

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("airlock_request_id", default="")
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def current_request_id() -> str:
    return _request_id.get()


def set_request_id(value: str) -> contextvars.Token[str]:
    return _request_id.set(value)


def reset_request_id(token: contextvars.Token[str]) -> None:
    _request_id.reset(token)


def clean_request_id(raw: str | None) -> str:
    """Accept a client's X-Request-Id if it is short and safe, else make one."""
    if raw and _VALID_REQUEST_ID.match(raw):
        return raw
    return uuid.uuid4().hex
