from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase

from console.requestctx import clean_request_id, reset_request_id, set_request_id


class RequestIdMiddleware:
    """Echo X-Request-Id (generated when absent) and expose it to services."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        request_id = clean_request_id(request.headers.get("X-Request-Id"))
        request.request_id = request_id  # type: ignore[attr-defined]
        token = set_request_id(request_id)
        try:
            response: HttpResponseBase = self.get_response(request)
        finally:
            reset_request_id(token)
        response["X-Request-Id"] = request_id
        return response

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        request_id = clean_request_id(request.headers.get("X-Request-Id"))
        request.request_id = request_id  # type: ignore[attr-defined]
        token = set_request_id(request_id)
        try:
            get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = self.get_response
            response = await get_response(request)
        finally:
            reset_request_id(token)
        response["X-Request-Id"] = request_id
        return response
