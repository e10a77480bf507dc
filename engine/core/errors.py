"""One error hierarchy for the whole domain.

Services raise DomainError with a machine-readable `code`; the API maps the
code to an HTTP status and an application/problem+json body, pages show the
message in the fragment. Nothing here knows about HTTP.
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    code: str = "domain_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        retryable: bool | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable
        self.extra: dict[str, Any] = extra or {}


class NotFound(DomainError):
    code = "not_found"


class Forbidden(DomainError):
    code = "forbidden"


class ValidationFailed(DomainError):
    code = "validation_error"


class StaleVersion(DomainError):
    """The observed version is no longer current (412 at the API)."""

    code = "stale_version"


class StaleFence(DomainError):
    """A newer fencing token has already been accepted for the resource."""

    code = "stale_fence"


class LockLost(DomainError):
    """The holder's lock expired or was taken; it must stop before writing."""

    code = "lock_lost"
    retryable = True


class LockBusy(DomainError):
    code = "lock_busy"
    retryable = True


class KillSwitchEngaged(DomainError):
    code = "kill_switch_engaged"
    retryable = True


class UndoRefused(DomainError):
    code = "undo_refused"


class UndoWindowExpired(DomainError):
    code = "undo_window_expired"


class InvalidTransition(DomainError):
    code = "invalid_transition"


def text_within(value: str | None, *, field: str, limit: int) -> str:
    """Free text as a service stores it: stripped, and at most `limit` characters
    (ValidationFailed naming `field` otherwise)."""
    text = (value or "").strip()
    if len(text) > limit:
        raise ValidationFailed(
            f"{field} is longer than {limit} characters",
            extra={"errors": [{"field": field, "message": "too long"}]},
        )
    return text
