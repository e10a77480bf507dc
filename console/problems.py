"""application/problem+json (RFC 9457) for every API error.

One table maps a DomainError `code` to an HTTP status; every 4xx/5xx the API
answers goes through `problem_response`, so the body always carries `type`,
`title`, `status`, `detail`, `code` and `retryable`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypedDict, Unpack

from django.db import OperationalError
from django.http import HttpRequest, HttpResponse
from ninja import Schema
from psycopg_pool import PoolTimeout
from pydantic import ConfigDict, Field

from console.requestctx import current_request_id
from engine.core.errors import DomainError

logger = logging.getLogger("airlock.api")

PROBLEM_CONTENT_TYPE = "application/problem+json"
PROBLEM_BASE = "/api/v1/problems/"

# code -> (status, title, retryable by default)
PROBLEMS: dict[str, tuple[int, str, bool]] = {
    "bad_request": (400, "Bad request", False),
    "validation_error": (422, "Validation failed", False),
    "malformed_json": (400, "Malformed JSON", False),
    "bad_header": (400, "Malformed header", False),
    "idempotency_key_missing": (400, "Idempotency-Key required", False),
    "idempotency_key_invalid": (400, "Idempotency-Key invalid", False),
    "if_match_invalid": (400, "If-Match must name one strong ETag", False),
    "unauthenticated": (401, "Authentication required", False),
    "forbidden": (403, "Forbidden", False),
    "self_approval": (403, "Forbidden: self approval", False),
    "not_in_write_set": (403, "Not in the run's write set", False),
    "not_found": (404, "Not found", False),
    "method_not_allowed": (405, "Method not allowed", False),
    "not_acceptable": (406, "Not acceptable", False),
    "run_not_active": (409, "Run not active", False),
    "write_set_conflict": (409, "Write set conflict", False),
    "idempotency_key_in_flight": (409, "Idempotency key in flight", True),
    "invalid_transition": (409, "Invalid state transition", False),
    "already_decided": (409, "Already decided", False),
    "claim_held": (409, "Someone else is on it", False),
    "approval_expired": (409, "Approval expired", False),
    "undo_window_expired": (409, "Undo window expired", False),
    "undo_refused": (409, "Undo refused", False),
    "already_undone": (409, "Already undone", False),
    "stale_fence": (409, "Stale fence", False),
    "lock_busy": (409, "Resource busy", True),
    "lock_lost": (409, "Lock lost", True),
    "conflict": (409, "Conflict", False),
    "stale_version": (412, "Stale version", False),
    "payload_too_large": (413, "Payload too large", False),
    "target_unavailable": (502, "Target unavailable", True),
    "weak_validator": (502, "Target has no strong validator", False),
    "unsupported_media_type": (415, "Unsupported media type", False),
    "idempotency_key_reused": (422, "Idempotency key reused", False),
    "leased": (423, "Leased by another run", True),
    "precondition_required": (428, "Precondition required", False),
    "rate_limited": (429, "Rate limited", True),
    "internal_error": (500, "Internal error", True),
    "not_implemented": (501, "Not implemented yet", False),
    "kill_switch_engaged": (503, "Kill switch engaged", True),
    "transient_conflict": (503, "Transient database conflict", True),
    "unavailable": (503, "Service unavailable", True),
}


def status_for_code(code: str) -> int:
    entry = PROBLEMS.get(code)
    return entry[0] if entry else 400


class ProblemOptions(TypedDict, total=False):
    """What a problem may say beyond its code and detail (ApiError, problem_response):
    a status other than the code's, its own retryable, extra members, headers."""

    status: int | None
    retryable: bool | None
    extra: dict[str, Any] | None
    headers: dict[str, str] | None


class ApiError(DomainError):
    """An error that only exists at the HTTP edge (headers, body syntax).

    `status` overrides the table when one code is used with two statuses
    (validation_error is 400 for malformed JSON, 422 otherwise).
    """

    def __init__(self, message: str, *, code: str, **options: Unpack[ProblemOptions]) -> None:
        super().__init__(
            message, code=code, retryable=options.get("retryable"), extra=options.get("extra")
        )
        self.status = options.get("status")
        self.headers = options.get("headers") or {}


class ProblemFieldError(Schema):
    field: str
    message: str


class Problem(Schema):
    """RFC 9457 problem details, with Airlock's `code` and `retryable` always present."""

    # Every code the API answers, with its status, title and default `retryable`, so
    # clients (airlock-client, generated tools) can check their error tables against it.
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "x-problem-codes": {
                code: {"status": status, "title": title, "retryable": retryable}
                for code, (status, title, retryable) in PROBLEMS.items()
            }
        },
    )

    type: str = Field(description="/api/v1/problems/<code>")
    title: str
    status: int
    detail: str
    code: str = Field(description="Machine-readable error code")
    retryable: bool = Field(description="May the same request be sent again unchanged?")
    request_id: str | None = None
    errors: list[ProblemFieldError] | None = None


def errors(*statuses: int) -> dict[int, type[Problem]]:
    """An endpoint's error responses for its OpenAPI `response=`: each a Problem."""
    return dict.fromkeys(statuses, Problem)


def problem_body(*, code: str, detail: str, **options: Unpack[ProblemOptions]) -> dict[str, Any]:
    """The problem+json body (headers, if given, are the response's business)."""
    default_status, title, default_retryable = PROBLEMS.get(code, (400, "Error", False))
    retryable = options.get("retryable")
    body: dict[str, Any] = {
        "type": f"{PROBLEM_BASE}{code}",
        "title": title,
        "status": options.get("status") or default_status,
        "detail": detail,
        "code": code,
        "retryable": default_retryable if retryable is None else retryable,
    }
    request_id = current_request_id()
    if request_id:
        body["request_id"] = request_id
    for key, value in (options.get("extra") or {}).items():
        if key not in body:
            body[key] = value
    return body


def problem_response(*, code: str, detail: str, **options: Unpack[ProblemOptions]) -> HttpResponse:
    body = problem_body(code=code, detail=detail, **options)
    response = HttpResponse(
        json.dumps(body, default=str).encode(),
        status=body["status"],
        content_type=PROBLEM_CONTENT_TYPE,
    )
    for name, value in (options.get("headers") or {}).items():
        response[name] = value
    return response


def problem_from_error(error: DomainError) -> HttpResponse:
    status = getattr(error, "status", None) or status_for_code(error.code)
    # A DomainError subclass may carry the class default retryable; the table
    # wins only when the error did not set its own.
    retryable = error.retryable if "retryable" in vars(error) else None
    if retryable is None and error.code not in PROBLEMS:
        retryable = error.retryable
    headers = dict(getattr(error, "headers", {}) or {})
    if "Retry-After" not in headers and (
        "retry_after" in error.extra or error.code == "rate_limited"
    ):
        headers["Retry-After"] = str(error.extra.get("retry_after", 1))
    return problem_response(
        code=error.code,
        detail=error.message,
        status=status,
        retryable=retryable,
        extra=error.extra,
        headers=headers,
    )


def is_problem(response: Any) -> bool:
    return str(response.get("Content-Type", "")).startswith(PROBLEM_CONTENT_TYPE)


def _field_name(loc: Any) -> str:
    parts = [str(part) for part in loc]
    # ninja prefixes the parameter source ("body", "query", "path", "header").
    return ".".join(parts) if parts else ""


def validation_errors_from_ninja(errors: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [
        {"field": _field_name(error.get("loc", ())), "message": str(error.get("msg", "invalid"))}
        for error in errors
    ]


# PostgreSQL SQLSTATEs that mean "this transaction lost a race; the same request
# may simply be sent again": deadlock_detected, serialization_failure,
# lock_not_available (lock_timeout), query_canceled (statement_timeout).
TRANSIENT_SQLSTATES = frozenset({"40P01", "40001", "55P03", "57014"})
TRANSIENT_RETRY_AFTER_SECONDS = 1


def database_sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (psycopg's, under Django's wrapper), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        sqlstate = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(sqlstate, str) and sqlstate:
            return sqlstate
        current = current.__cause__ or current.__context__
    return None


def _pool_exhausted(exc: BaseException) -> bool:
    """Did the request wait AIRLOCK_DB_POOL_TIMEOUT for a pooled connection in vain?"""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, PoolTimeout):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def transient_database_response(exc: BaseException) -> HttpResponse | None:
    """503 problem+json with Retry-After for a Django OperationalError: the
    transaction was rolled back (deadlock, serialization failure, lock or
    statement timeout: `transient_conflict`) or the database was unreachable
    (`unavailable`). Nothing was written; the same request may be retried.
    None for any other exception."""
    if not isinstance(exc, OperationalError):
        return None
    sqlstate = database_sqlstate(exc)
    headers = {"Retry-After": str(TRANSIENT_RETRY_AFTER_SECONDS)}
    if sqlstate in TRANSIENT_SQLSTATES:
        logger.warning("transient database conflict (SQLSTATE %s); answered 503", sqlstate)
        return problem_response(
            code="transient_conflict",
            detail="The request collided with a concurrent change and was rolled back; "
            "nothing was written. Send it again.",
            extra={"sqlstate": sqlstate, "retry_after": TRANSIENT_RETRY_AFTER_SECONDS},
            headers=headers,
        )
    if _pool_exhausted(exc):
        # Overload, not an outage: every pooled connection of this process stayed busy.
        logger.warning("no pooled database connection free within the timeout; answered 503")
        return problem_response(
            code="unavailable",
            detail="The server is at its database connection limit; nothing was written. "
            "Try again shortly.",
            extra={"retry_after": TRANSIENT_RETRY_AFTER_SECONDS},
            headers=headers,
        )
    logger.warning("database operational error (SQLSTATE %s); answered 503", sqlstate)
    return problem_response(
        code="unavailable",
        detail="The database is unavailable; nothing was written. Try again shortly.",
        extra={"retry_after": TRANSIENT_RETRY_AFTER_SECONDS},
        headers=headers,
    )


def unexpected_error_response(request: HttpRequest, exc: BaseException) -> HttpResponse:
    transient = transient_database_response(exc)
    if transient is not None:
        return transient
    logger.exception("unhandled error on %s %s", request.method, request.path, exc_info=exc)
    return problem_response(
        code="internal_error",
        detail="An unexpected error occurred; it has been logged with the request id.",
    )
