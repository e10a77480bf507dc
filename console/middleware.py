from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from console.problems import transient_database_response
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

    def process_exception(self, request: HttpRequest, exception: Exception) -> Any:
        """A console page that lost a database race (deadlock, serialization
        failure) or the database: 503 with Retry-After instead of a 500. The
        transaction was rolled back; submitting again is safe. (API requests never
        get here: their wrapper answers problem+json first.)"""
        problem = transient_database_response(exception)
        if problem is None:
            return None
        response = HttpResponse(
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            "<title>Busy, try again</title></head><body><h1>Busy, try again</h1>"
            "<p>Your request collided with another change and was rolled back; "
            "nothing was saved. Go back and submit it again.</p></body></html>",
            status=503,
            content_type="text/html; charset=utf-8",
        )
        response["Retry-After"] = problem["Retry-After"]
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
