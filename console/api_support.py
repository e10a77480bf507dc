"""Small HTTP helpers shared by the API routers: JSON responses, body reading,
cursors, write rate limiting. (API area; kept apart from console/api.py so the
routers can import it without importing the assembled API.)"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

import redis
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from pydantic import BeforeValidator

from approvals.services import idempotency
from approvals.services.idempotency import StoredResponse
from approvals.services.preconditions import TagCondition
from approvals.services.tokens import Principal
from audit.services import Actor
from console.auth import PERSON, Bearer, principal_of
from console.problems import ApiError, problem_from_error
from console.redis_clients import shared_redis
from engine.core import jsonsafe
from engine.core.errors import DomainError, Forbidden

logger = logging.getLogger("airlock.api")

JSON_CONTENT_TYPE = "application/json"
# PostgreSQL text and jsonb cannot hold NUL: free text is any string without it.
TEXT_PATTERN = r"^[^\x00]*$"


def _json_int(value: Any) -> Any:
    """JSON Schema integers: 5 and 5.0 are integers; "5" and true are not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_json_int)]


def json_bool(value: Any) -> Any:
    """true/false only (a Literal[False] would otherwise accept 0)."""
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def json_bytes(data: Any) -> bytes:
    return json.dumps(data, default=str, separators=(",", ":")).encode("utf-8")


def json_response(
    data: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> HttpResponse:
    response = HttpResponse(json_bytes(data), status=status, content_type=JSON_CONTENT_TYPE)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def conditional_response(
    *, etag: str, body: bytes, condition: TagCondition | None, wait: int | None
) -> HttpResponse:
    """200 with the body, or 304 while `condition` (If-None-Match) still matches."""
    if condition is not None and condition.weak_match(etag):
        response = HttpResponse(status=304)
    else:
        response = HttpResponse(body, status=200, content_type="application/json")
    response["ETag"] = etag
    response["Cache-Control"] = "no-cache"
    if wait is not None:
        response["Preference-Applied"] = f"wait={wait}"
        response["Vary"] = "Prefer"
    return response


def replay_response(stored: StoredResponse) -> HttpResponse:
    """The stored answer to an idempotent request, marked as a replay."""
    response = HttpResponse(stored.body, status=stored.status)
    for header, value in stored.headers.items():
        response[header] = value
    response["Idempotent-Replayed"] = "true"
    return response


def idempotency_claim(
    request: HttpRequest, *, actor: Actor, key: str, method: str, body: bytes
) -> HttpResponse | int:
    """Claim the Idempotency-Key `key` of `actor` for this request (its method, path and
    body): the id of the new record to store the answer under, or the replayed answer
    of the request that used the key first. Raises what `idempotency_begin` raises."""
    begin = idempotency.idempotency_begin(
        actor=actor,
        key=key,
        method=method,
        path=request.path,
        fingerprint=idempotency.request_fingerprint(method=method, path=request.path, body=body),
    )
    if begin.replay is not None:
        return replay_response(begin.replay)
    assert begin.record_id is not None
    return begin.record_id


def store_for_replay(record_id: int, response: HttpResponse, *, action_id: Any = None) -> None:
    """Keep this answer under its Idempotency-Key (inside the transaction that made it)."""
    headers = {
        name: response[name]
        for name in ("Content-Type", "Location", "ETag")
        if response.has_header(name)
    }
    stored = StoredResponse(status=response.status_code, headers=headers, body=response.content)
    idempotency.idempotency_complete(record_id=record_id, response=stored, action_id=action_id)


def propose_for_replay(
    record_id: int,
    propose: Callable[[Callable[[Any], None], Callable[[DomainError], None]], Any],
    render: Callable[[Any], tuple[HttpResponse, Any]],
) -> HttpResponse:
    """Run a proposal (a write, a plan) whose answer is kept under its Idempotency-Key
    inside the proposal's own transaction: the 202 of what it recorded (`render` gives
    the response and the action it names, if any) or the problem of a refused stale
    tag, which is an answer too. A response counts as produced only once stored: if
    storing fails (the key was taken over), the proposal rolls back and the error is
    the answer. Any other error frees the key."""
    produced: dict[str, HttpResponse] = {}

    def on_recorded(recorded: Any) -> None:
        response, action_id = render(recorded)
        store_for_replay(record_id, response, action_id=action_id)
        produced["response"] = response

    def on_refused(error: DomainError) -> None:
        response = problem_from_error(error)
        store_for_replay(record_id, response)
        produced["response"] = response

    try:
        propose(on_recorded, on_refused)
    except DomainError as error:
        if "response" in produced:  # the refused stale proposal, stored for replay
            return produced["response"]
        idempotency.idempotency_release(record_id=record_id)
        raise error from None
    except BaseException:
        idempotency.idempotency_release(record_id=record_id)
        raise
    return produced["response"]


def read_body(request: HttpRequest) -> bytes:
    """The raw body, refusing anything over AIRLOCK_MAX_BODY_BYTES with 413."""
    limit = int(settings.AIRLOCK_MAX_BODY_BYTES)
    declared = request.META.get("CONTENT_LENGTH") or "0"
    try:
        declared_length = int(declared)
    except ValueError as exc:
        raise ApiError("Content-Length is not a number.", code="bad_header") from exc
    if declared_length > limit:
        raise _too_large(limit)
    try:
        body = request.body
    except RequestDataTooBig as exc:
        raise _too_large(limit) from exc
    if len(body) > limit:
        raise _too_large(limit)
    return body


def _too_large(limit: int) -> ApiError:
    return ApiError(
        f"The body is larger than {limit} bytes.",
        code="payload_too_large",
        extra={"limit_bytes": limit},
    )


def _json_media_type(content_type: str, allowed: tuple[str, ...]) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media in allowed or (media.startswith("application/") and media.endswith("+json"))


def parse_json_object(
    body: bytes,
    *,
    content_type: str,
    allowed_types: tuple[str, ...] = ("application/json",),
    field: str = "body",
) -> dict[str, Any]:
    """Malformed JSON -> 400; well-formed but not an object -> 422; wrong media type -> 415."""
    if content_type and not _json_media_type(content_type, allowed_types):
        raise ApiError(
            f"Send the body as {' or '.join(allowed_types)}.",
            code="unsupported_media_type",
        )
    if not body:
        raise ApiError(
            "A JSON object body is required.",
            code="validation_error",
            status=422,
            extra={"errors": [{"field": field, "message": "required"}]},
        )
    # Malformed -> 400, past the depth/length limits -> 422 (engine/core/jsonsafe.py).
    value = jsonsafe.loads(body, field=field)
    if not isinstance(value, dict):
        raise ApiError(
            "The body must be a JSON object.",
            code="validation_error",
            status=422,
            extra={"errors": [{"field": field, "message": "must be a JSON object"}]},
        )
    return value


# --- Role-checked personal tokens ----------------------------------------------


class RoleBearer(Bearer):
    """A personal token whose person passes `allowed`, else 403 `forbidden`.

    Decided while authenticating, i.e. before ninja validates the body: a
    person without the role learns nothing about the schema from a 422.
    """

    def __init__(self, allowed: Callable[[Any], bool], refusal: str) -> None:
        super().__init__(PERSON)
        self.allowed = allowed
        self.refusal = refusal

    def authenticate(self, request: HttpRequest, token: str) -> Principal | None:
        principal = super().authenticate(request, token)
        if principal is not None and not self.allowed(principal.user):
            raise Forbidden(self.refusal)
        return principal


# --- Cursors ---------------------------------------------------------------

# Keyset cursors whose every pattern-valid value is a valid position:
# "<microseconds since epoch>.<uuid hex>" for time-ordered lists, and the
# last `kind/name` for resources.
TIME_CURSOR_PATTERN = r"^[0-9]{1,16}\.[0-9a-f]{32}$"
RESOURCE_CURSOR_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}/[A-Za-z0-9][A-Za-z0-9._:@+=,-]{0,254}$"
# A list's `?limit=`: the page size when none is asked, and the most one page holds.
PAGE_LIMIT_DEFAULT = 50
PAGE_LIMIT_MAX = 200


def _time_encode(values: list[Any]) -> str:
    moment, row_id = values
    micros = int(moment.timestamp() * 1_000_000)
    return f"{micros}.{uuid.UUID(str(row_id)).hex}"


def _time_decode(cursor: str) -> list[Any]:
    try:
        micros, _, hex_id = cursor.partition(".")
        moment = datetime.fromtimestamp(int(micros) / 1_000_000, tz=UTC)
        return [moment, uuid.UUID(hex=hex_id)]
    except (ValueError, OverflowError, OSError) as exc:
        raise _bad_cursor() from exc


def _bad_cursor() -> ApiError:
    return ApiError(
        "The cursor is not one this API issued.",
        code="validation_error",
        status=422,
        extra={"errors": [{"field": "cursor", "message": "invalid cursor"}]},
    )


@dataclass(frozen=True)
class Keyset:
    """How a list is ordered (a unique key, compared as a tuple) and how the
    position after a page's last row is written into a cursor."""

    fields: tuple[str, ...]
    descending: bool
    encode: Callable[[list[Any]], str]
    # Raises ApiError (422) for a cursor it did not issue.
    decode: Callable[[str], list[Any]]


NEWEST_FIRST = Keyset(("created_at", "id"), True, _time_encode, _time_decode)
OLDEST_FIRST = Keyset(("created_at", "id"), False, _time_encode, _time_decode)


def opaque_keyset(fields: tuple[str, ...], *, descending: bool = True) -> Keyset:
    """A keyset whose cursor is the opaque base64 JSON of the key (console pages)."""

    def decode(cursor: str) -> list[Any]:
        return cursor_decode(cursor, size=len(fields)) or []

    return Keyset(fields, descending, cursor_encode, decode)


def _after(keyset: Keyset, values: list[Any]) -> Q:
    """Rows strictly after `values` in the keyset's order (a lexicographic tuple compare)."""
    beyond = "lt" if keyset.descending else "gt"
    condition = Q()
    for index, field in enumerate(keyset.fields):
        equal = {name: value for name, value in zip(keyset.fields[:index], values, strict=False)}
        condition |= Q(**equal, **{f"{field}__{beyond}": values[index]})
    return condition


def keyset_page_query(queryset: Any, *, keyset: Keyset, after: list[Any] | None, limit: int) -> Any:
    """The rows of one page in the keyset's order, after the position `after` (a cursor's
    decoded values; None: the first page), and one more: whether a next page exists. The
    statement the read front compiles too (approvals/api/fastpoll_routes.py)."""
    if after is not None:
        queryset = queryset.filter(_after(keyset, after))
    order = [f"-{field}" if keyset.descending else field for field in keyset.fields]
    return queryset.order_by(*order)[: limit + 1]


def keyset_page(rows: list[Any], *, keyset: Keyset, limit: int) -> tuple[list[Any], str | None]:
    """`keyset_page_query`'s rows as one page and the cursor of the next (None: the last)."""
    if len(rows) <= limit:
        return rows, None
    page = rows[:limit]
    return page, keyset.encode([getattr(page[-1], field) for field in keyset.fields])


def keyset_paginate(
    queryset: Any, *, keyset: Keyset, cursor: str | None, limit: int, lenient: bool = False
) -> tuple[list[Any], str | None]:
    """One page in the keyset's order and the cursor of the next page (None: the last).

    Keyset, not OFFSET: page N costs what page 1 costs on a large table. A cursor
    this list did not issue is a 422, or (``lenient``, the console pages) starts over.
    """
    after = None
    if cursor:
        try:
            after = keyset.decode(cursor)
        except ApiError:
            if not lenient:
                raise
    rows = list(keyset_page_query(queryset, keyset=keyset, after=after, limit=limit))
    return keyset_page(rows, keyset=keyset, limit=limit)


def page_json(
    page: list[Any], next_cursor: str | None, render: Callable[[Any], dict[str, Any]]
) -> dict[str, Any]:
    """A list endpoint's body: `{"items": [...], "next": cursor or null}`."""
    return {"items": [render(row) for row in page], "next": next_cursor}


def page_response(
    queryset: Any,
    *,
    keyset: Keyset,
    cursor: str | None,
    limit: int,
    render: Callable[[Any], dict[str, Any]],
) -> HttpResponse:
    """A list endpoint's answer: `page_json` of the page."""
    page, next_cursor = keyset_paginate(queryset, keyset=keyset, cursor=cursor, limit=limit)
    return json_response(page_json(page, next_cursor, render))


def cursor_encode(values: list[Any]) -> str:
    raw = json.dumps(values, default=str, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def cursor_decode(cursor: str | None, *, size: int) -> list[Any] | None:
    if not cursor:
        return None
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = jsonsafe.loads(base64.urlsafe_b64decode(padded.encode()), field="cursor")
    except (ValueError, TypeError, DomainError) as exc:
        raise _bad_cursor() from exc
    if not isinstance(values, list) or len(values) != size:
        raise _bad_cursor()
    return values


# --- Write rate limiting -----------------------------------------------------


def rate_limit_writes(principal: Principal) -> None:
    """A fixed one-minute window per token in Redis; 429 with Retry-After when full.

    Fails open when Redis is unreachable: refusing every write because the
    counter store is down would turn a Redis blip into an outage.
    """
    limit = int(settings.AIRLOCK_WRITE_RATE_PER_MINUTE)
    now = time.time()
    window = int(now // 60)
    key = f"airlock:ratelimit:{principal.token_prefix}:{window}"
    try:
        pipe = shared_redis(settings.REDIS_URL, timeout=1).pipeline()
        pipe.incr(key)
        pipe.expire(key, 61)
        count = int(pipe.execute()[0])
    except redis.RedisError:
        logger.warning("rate limiter unavailable; allowing the write", exc_info=True)
        return
    if count > limit:
        retry_after = max(1, int((window + 1) * 60 - now) + 1)
        raise ApiError(
            f"More than {limit} writes per minute with this token.",
            code="rate_limited",
            retryable=True,
            extra={"retry_after": retry_after, "limit_per_minute": limit},
            headers={"Retry-After": str(retry_after)},
        )


def writing_principal(request: HttpRequest) -> Principal:
    """The caller of a write endpoint, once its token is within the write rate."""
    principal = principal_of(request)
    rate_limit_writes(principal)
    return principal
