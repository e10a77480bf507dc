"""The assembled REST API under /api/v1: routers, auth, problem+json errors,
OpenAPI 3.1 document and an offline docs page.

Every error leaves as application/problem+json: DomainErrors through one
code -> status table (console/problems.py), ninja's own validation and parse
errors, and Django's 404/405/500 for anything under /api/v1 (wrapped in
console/urls_api.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from django.core.exceptions import RequestDataTooBig
from django.db import DataError, OperationalError
from django.http import Http404, HttpRequest, HttpResponse
from django.utils.html import escape
from ninja import Field, NinjaAPI, Router, Schema
from ninja.errors import AuthenticationError, HttpError
from ninja.errors import ValidationError as NinjaValidationError
from ninja.openapi.docs import DocsBase
from ninja.parser import Parser
from pydantic import BeforeValidator, ConfigDict

from approvals.api import router as approvals_router
from audit.api import router as audit_router
from console.api_support import (
    RoleBearer,
    iso,
    json_bool,
    json_response,
    writing_principal,
)
from console.auth import any_token, principal_of
from console.models import KillSwitch
from console.permissions import is_operator
from console.problems import (
    PROBLEM_CONTENT_TYPE,
    errors,
    problem_from_error,
    problem_response,
    transient_database_response,
    unexpected_error_response,
    validation_errors_from_ninja,
)
from console.services import kill_switch_set
from engine.core import jsonsafe
from engine.core.errors import DomainError
from engine.core.killswitch import SCOPE_MAX_LENGTH, SCOPE_PATTERN
from notifications.api import router as notifications_router
from ownership.api import router as ownership_router

API_TITLE = "Airlock API"
API_VERSION = "1.0.0"
API_DESCRIPTION = (
    "Agents declare a write set, read resources with ETags, send conditional writes "
    "with idempotency keys and poll (or long-poll) for results; people approve, resolve "
    "conflicts and hold the kill switch. Every error is application/problem+json with "
    "`code` and `retryable`.\n\n"
    "**Run tokens die with their run.** The token of a run that is rejected, finished, "
    "expired or revoked still reads that run (`GET /runs/{id}`, `GET /runs`) and that run's "
    "actions (`GET /actions/{id}`), so the agent learns why; the writes that take a run "
    "token (`PUT`/`PATCH`/`DELETE /resources/…`, heartbeat, finish, cancel, undo) answer "
    "`409 run_not_active`; every other operation answers `401`.\n\n"
    '**Leases.** A write-set entry may carry `"lease": true`: when the run becomes active it '
    "holds an exclusive, fenced lease on those resources until it ends (finish, revoke, "
    "expiry; heartbeats extend it). Another run's write to a leased resource is `423 leased` "
    "with `lease: {run, expires_at}`; two runs never hold overlapping leases, and a lease is "
    "not granted while another run's write to those resources is still in flight (both "
    "`409 write_set_conflict`, the run stays pending). A `stop_unless_lease` class reports "
    "`lease_covered` on a conflict.\n\n"
    "**Transient errors.** A request that loses a database race (deadlock, serialization "
    "failure) is rolled back and answered `503 transient_conflict` with `Retry-After` and "
    "`retryable: true`."
)


class OfflineSwagger(DocsBase):
    """Swagger UI from assets vendored in django-ninja, served by this app: no CDN,
    no inline script (works under the strict CSP)."""

    def render_page(self, request: HttpRequest, api: NinjaAPI, **kwargs: Any) -> HttpResponse:
        settings_json = json.dumps(
            {"url": "/api/v1/openapi.json", "layout": "BaseLayout", "deepLinking": True}
        )
        html = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(api.title)}</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="/api/v1/docs/assets/swagger-ui.css">
</head>
<body data-csrf-token="" data-api-csrf="">
<script type="application/json" id="swagger-settings">{escape(settings_json)}</script>
<div id="swagger-ui"></div>
<script src="/api/v1/docs/assets/swagger-ui-bundle.js"></script>
<script src="/api/v1/docs/assets/swagger-ui-init.js"></script>
</body>
</html>"""
        # escape() turned the JSON's quotes into entities, which JSON.parse would
        # reject: the settings contain no '<', so plain JSON is safe here.
        html = html.replace(escape(settings_json), settings_json)
        return HttpResponse(html, content_type="text/html; charset=utf-8")


class SafeJsonParser(Parser):
    """Ninja's body parser, through the one JSON parser (engine/core/jsonsafe.py):
    depth, length, NaN and lone-surrogate limits for every schema-typed body too."""

    def parse_body(self, request: HttpRequest) -> dict[str, Any]:
        value: dict[str, Any] = jsonsafe.loads(request.body)
        return value


class AirlockAPI(NinjaAPI):
    def get_openapi_schema(self, *args: Any, **kwargs: Any) -> Any:
        schema = super().get_openapi_schema(*args, **kwargs)
        return _finish_openapi(schema)

    def get_openapi_operation_id(self, operation: Any) -> str:
        """`<app>_api_<handler>`, whichever module of an app's api package holds it."""
        module = operation.view_func.__module__.split(".api.", 1)[0].removesuffix(".api")
        return f"{module}_api_{operation.view_func.__name__}".replace(".", "_")


def _finish_openapi(schema: Any) -> Any:
    """Error responses are application/problem+json; 304s have no body."""
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            operation["responses"] = _merged_responses(operation["responses"])
            _problem_bodies(operation["responses"])
            _implied_errors(operation)
            unique = _unique_parameters(operation.get("parameters", []))
            if unique:
                operation["parameters"] = unique
    return schema


def _merged_responses(responses: dict[Any, Any]) -> dict[str, Any]:
    """openapi_extra adds "200" beside ninja's 200: merge them into one key (a JSON
    document with duplicate keys is not valid YAML for clients)."""
    merged: dict[str, Any] = {}
    for raw_status, response in responses.items():
        key = str(raw_status)
        if key not in merged:
            merged[key] = dict(response)
            continue
        combined = dict(merged[key])
        for field, value in response.items():
            if isinstance(value, dict) and isinstance(combined.get(field), dict):
                combined[field] = {**combined[field], **value}
            else:
                combined.setdefault(field, value)
        merged[key] = combined
    return merged


def _problem_bodies(responses: dict[str, Any]) -> None:
    for status, response in responses.items():
        if status == "304":
            response.pop("content", None)
            continue
        if not (status.isdigit() and int(status) >= 400):
            continue
        content = response.get("content") or {}
        body = content.get("application/json") or next(iter(content.values()), None)
        if body is not None:
            response["content"] = {PROBLEM_CONTENT_TYPE: body}
        if status in ("429", "503") and "Retry-After" not in response.get("headers", {}):
            response.setdefault("headers", {})["Retry-After"] = {"schema": {"type": "string"}}


_PROBLEM_CONTENT = {PROBLEM_CONTENT_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}


def _implied_errors(operation: dict[str, Any]) -> None:
    responses = operation["responses"]
    # Any operation with parameters or a body can fail validation.
    if (operation.get("parameters") or operation.get("requestBody")) and "422" not in responses:
        responses["422"] = {"description": "Validation failed", "content": _PROBLEM_CONTENT}
    # Any operation that touches the database may lose a race (deadlock,
    # serialization failure): 503 transient_conflict, retryable, Retry-After.
    if "503" not in responses:
        responses["503"] = {
            "description": "transient_conflict (the transaction lost a race with a "
            "concurrent change and was rolled back) or unavailable: nothing was "
            "written; retry after Retry-After",
            "headers": {"Retry-After": {"schema": {"type": "string"}}},
            "content": _PROBLEM_CONTENT,
        }


def _unique_parameters(parameters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ninja merges openapi_extra parameters after its own; keep one per name."""
    seen: set[tuple[str, str]] = set()
    unique = []
    for parameter in parameters:
        key = (parameter.get("in", ""), parameter.get("name", "").lower())
        if key not in seen:
            seen.add(key)
            unique.append(parameter)
    return unique


api = AirlockAPI(
    title=API_TITLE,
    version=API_VERSION,
    description=API_DESCRIPTION,
    urls_namespace="api-v1",
    docs=OfflineSwagger(),
    docs_url="/docs",
    openapi_url="/openapi.json",
    parser=SafeJsonParser(),
)


# --- Error handlers ----------------------------------------------------------------


@api.exception_handler(DomainError)
def _domain_error(request: HttpRequest, exc: DomainError) -> HttpResponse:
    return problem_from_error(exc)


@api.exception_handler(NinjaValidationError)
def _validation_error(request: HttpRequest, exc: NinjaValidationError) -> HttpResponse:
    field_errors = validation_errors_from_ninja(list(exc.errors))
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in field_errors[:5])
    return problem_response(
        code="validation_error",
        detail=detail or "The request is invalid.",
        status=422,
        extra={"errors": field_errors},
    )


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return problem_response(
        code="unauthenticated",
        detail="Send Authorization: Bearer <token> with a valid, unexpired, unrevoked token.",
        headers={"WWW-Authenticate": 'Bearer realm="airlock"'},
    )


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if isinstance(exc.__cause__, RequestDataTooBig):
        return problem_response(code="payload_too_large", detail="The body is too large.")
    if isinstance(exc.__cause__, DomainError):
        # The body parser's refusal (jsonsafe): 400 malformed or 422 past a limit.
        return problem_from_error(exc.__cause__)
    if exc.status_code == 400:
        return problem_response(
            code="validation_error",
            status=400,
            detail="The body is not valid JSON.",
        )
    code = {401: "unauthenticated", 403: "forbidden", 404: "not_found", 429: "rate_limited"}.get(
        exc.status_code, "bad_request"
    )
    return problem_response(code=code, detail=str(exc.message), status=exc.status_code)


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return problem_response(code="not_found", detail="Not found.")


@api.exception_handler(RequestDataTooBig)
def _too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    return problem_response(code="payload_too_large", detail="The body is too large.")


@api.exception_handler(DataError)
def _data_error(request: HttpRequest, exc: DataError) -> HttpResponse:
    # e.g. a NUL byte PostgreSQL cannot store: the input was bad, not the server.
    return problem_response(
        code="bad_request", detail="The request contains characters that cannot be stored."
    )


@api.exception_handler(OperationalError)
def _operational_error(request: HttpRequest, exc: OperationalError) -> HttpResponse:
    # A deadlock / serialization failure (40P01 / 40001) or a lost database:
    # 503 transient_conflict / unavailable, retryable, with Retry-After. Never a 500.
    response = transient_database_response(exc)
    return response if response is not None else unexpected_error_response(request, exc)


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    return unexpected_error_response(request, exc)


# --- Kill switch ---------------------------------------------------------------

kill_switch_router = Router()


class KillSwitchOut(Schema):
    scope: str
    engaged: bool
    reason: str
    by: str | None
    at: str | None


class KillSwitchList(Schema):
    switches: list[KillSwitchOut]


_SCOPE_FIELD = Field(
    "*",
    max_length=SCOPE_MAX_LENGTH,
    pattern=SCOPE_PATTERN,
    description="`*` (everything), `kind/prefix*` or `kind/name`",
)


class KillSwitchEngageIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    engaged: Annotated[Literal[True], BeforeValidator(json_bool)]
    scope: str = _SCOPE_FIELD
    reason: str = Field(..., min_length=1, max_length=1000, pattern=r"^[^\x00]*\S[^\x00]*$")


class KillSwitchReleaseIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    engaged: Annotated[Literal[False], BeforeValidator(json_bool)]
    scope: str = _SCOPE_FIELD
    reason: str = Field("", max_length=1000, pattern=r"^[^\x00]*$")


def _switch_json(switch: KillSwitch) -> dict[str, Any]:
    return {
        "scope": switch.scope,
        "engaged": switch.engaged,
        "reason": switch.reason,
        "by": switch.changed_by.get_username() if switch.changed_by else None,
        "at": iso(switch.changed_at),
    }


def _switches() -> dict[str, Any]:
    return {
        "switches": [_switch_json(s) for s in KillSwitch.objects.select_related("changed_by").all()]
    }


@kill_switch_router.get(
    "/kill-switch",
    auth=any_token,
    response={200: KillSwitchList, **errors(401)},
    summary="Kill-switch scopes and their state",
    tags=["kill switch"],
)
def kill_switch_get(request: HttpRequest) -> HttpResponse:
    return json_response(_switches())


@kill_switch_router.post(
    "/kill-switch",
    # The role is decided before the body is validated (no schema leak).
    auth=RoleBearer(is_operator, "Only operators may use the kill switch."),
    response={200: KillSwitchList, **errors(400, 401, 403, 413, 422, 429)},
    summary="Engage or release one scope (operators and admins)",
    tags=["kill switch"],
)
def kill_switch_post(
    request: HttpRequest, payload: KillSwitchEngageIn | KillSwitchReleaseIn
) -> HttpResponse:
    principal = writing_principal(request)
    kill_switch_set(
        scope=payload.scope,
        engaged=payload.engaged,
        reason=payload.reason,
        actor=principal.actor,
    )
    return json_response(_switches())


class PingOut(Schema):
    principal: Literal["agent", "run", "person"]
    name: str


@kill_switch_router.get(
    "/whoami",
    auth=any_token,
    response={200: PingOut, **errors(401)},
    summary="Who the token identifies",
    tags=["identity"],
)
def whoami(request: HttpRequest) -> HttpResponse:
    principal = principal_of(request)
    return json_response({"principal": principal.kind, "name": principal.label})


api.add_router("", approvals_router)
api.add_router("", ownership_router)
api.add_router("", audit_router)
api.add_router("", kill_switch_router)
api.add_router("", notifications_router)
