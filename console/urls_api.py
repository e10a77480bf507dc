"""API routes: /api/v1/... (django-ninja), /healthz, /metrics.

Every API view is wrapped so that whatever leaves /api/v1 is JSON or
problem+json: Django's own 404/405, an oversize body (413, refused before the
body is read) and any unexpected exception (500). The wrapper also measures
request latency for /metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ninja
from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.http import FileResponse, HttpRequest, HttpResponse, HttpResponseBase
from django.urls import URLPattern, URLResolver, path, re_path

from console import ops
from console.api import api
from console.problems import is_problem, problem_response, unexpected_error_response

_ASSETS_DIR = Path(ninja.__file__).parent / "static" / "ninja"
_ASSETS = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui-init.js": "text/javascript",
}


def _too_large(request: HttpRequest) -> HttpResponseBase | None:
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return problem_response(code="bad_header", detail="Content-Length is not a number.")
    limit = int(settings.AIRLOCK_MAX_BODY_BYTES)
    if length > limit:
        return problem_response(
            code="payload_too_large",
            detail=f"The body is larger than {limit} bytes.",
            extra={"limit_bytes": limit},
        )
    return None


def _as_problem(response: HttpResponseBase) -> HttpResponseBase:
    """Django's plain 404/405 under /api/v1 become problem+json."""
    if response.status_code < 400 or is_problem(response):
        return response
    if response.status_code == 405:
        problem = problem_response(
            code="method_not_allowed",
            detail="This method is not allowed here.",
        )
        if response.has_header("Allow"):
            problem["Allow"] = response["Allow"]
        return problem
    if response.status_code == 404:
        return problem_response(code="not_found", detail="Not found.")
    return response


def _finish(
    request: HttpRequest, route: str, started: float, response: HttpResponseBase
) -> HttpResponseBase:
    ops.observe_request(
        method=request.method or "",
        route=route,
        status=response.status_code,
        seconds=time.perf_counter() - started,
    )
    return response


def _wrap(view: Callable[..., Any], route: str) -> Callable[..., Any]:
    if iscoroutinefunction(view):

        async def async_wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            response = _too_large(request)
            if response is None:
                try:
                    response = _as_problem(await view(request, *args, **kwargs))
                except Exception as exc:
                    response = unexpected_error_response(request, exc)
            return _finish(request, route, started, response)

        async_wrapped.csrf_exempt = True  # type: ignore[attr-defined]
        return async_wrapped

    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        response = _too_large(request)
        if response is None:
            try:
                response = _as_problem(view(request, *args, **kwargs))
            except Exception as exc:
                response = unexpected_error_response(request, exc)
        return _finish(request, route, started, response)

    wrapped.csrf_exempt = True  # type: ignore[attr-defined]
    return wrapped


def _wrapped_api_patterns(patterns: list[Any]) -> list[URLPattern | URLResolver]:
    for pattern in patterns:
        if isinstance(pattern, URLPattern):
            route = "/api/v1/" + str(pattern.pattern)
            pattern.callback = _wrap(pattern.callback, route)
    return list(patterns)


def docs_asset(request: HttpRequest, name: str) -> HttpResponseBase:
    if name not in _ASSETS:
        return problem_response(code="not_found", detail="No such docs asset.")
    response = FileResponse(open(_ASSETS_DIR / name, "rb"), content_type=_ASSETS[name])  # noqa: SIM115
    response["Cache-Control"] = "public, max-age=86400"
    return response


def api_not_found(request: HttpRequest, rest: str = "") -> HttpResponse:
    return problem_response(code="not_found", detail=f"No API route {request.path}.")


_api_patterns, _api_app, _api_namespace = api.urls
_wrapped = _wrapped_api_patterns(_api_patterns)

urlpatterns: list[URLPattern | URLResolver] = [
    path("healthz", ops.healthz, name="healthz"),
    path("readyz", ops.readyz, name="readyz"),
    path("metrics", ops.metrics, name="metrics"),
    path("api/v1/docs/assets/<str:name>", docs_asset, name="api-docs-asset"),
    path("api/v1/", (_wrapped, _api_app, _api_namespace)),
    re_path(r"^api/v1(?P<rest>/.*)?$", _wrap(api_not_found, "/api/v1/<unknown>")),
]
