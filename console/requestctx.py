"""The current request id, carried in a context variable.

Services record it in every audit event without it being threaded through
every call; jobs set it from the action they execute.
"""

from __future__ import annotations

import contextvars
import re
import uuid
from typing import Any

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


# What the log lines of this request or job carry beside their message (the principal,
# and where known the run, action, resource, fence and RQ job): console.logging_filters
# adds them to every record. Never a token or a secret: a principal is "kind:name".
_log_fields: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "airlock_log_fields", default=None
)


def log_fields() -> dict[str, str]:
    return _log_fields.get() or {}


def log_fields_start(**values: str) -> contextvars.Token[dict[str, str] | None]:
    """A fresh set of fields for one request or job (reset with `log_fields_reset`)."""
    return _log_fields.set({k: v for k, v in values.items() if v})


def log_fields_reset(token: contextvars.Token[dict[str, str] | None]) -> None:
    _log_fields.reset(token)


def log_fields_add(**values: str) -> None:
    """Add fields to the current request's or job's set (outside one: a set of its own)."""
    current = _log_fields.get()
    added = {k: v for k, v in values.items() if v}
    if current is None:
        _log_fields.set(added)
    else:
        current.update(added)


def log_action(action: Any) -> None:
    """The action a job works on, on its log lines: its id, run and resource."""
    log_fields_add(
        action=str(action.pk),
        run=str(action.run_id or ""),
        resource=str(action.resource_identifier),
    )


def log_fence(fence: int | None) -> None:
    """The fence a job's write carries, on its log lines from here on."""
    if fence is not None:
        log_fields_add(fence=str(fence))
