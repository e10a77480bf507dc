from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import (
    ThreadSensitiveContext,
    iscoroutinefunction,
    markcoroutinefunction,
    sync_to_async,
)
from csp import middleware as csp_middleware
from django.conf import settings
from django.contrib.auth import middleware as auth_middleware
from django.contrib.messages import middleware as messages_middleware
from django.contrib.sessions import middleware as sessions_middleware
from django.core.handlers.asgi import ASGIHandler
from django.db import connections
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.middleware import clickjacking, common, csrf, security
from django.utils.deprecation import MiddlewareMixin

from console.problems import transient_database_response
from console.requestctx import (
    clean_request_id,
    log_fields_reset,
    log_fields_start,
    reset_request_id,
    set_request_id,
)

# Idle request threads a web process keeps for the next requests (RequestThreads).
REQUEST_THREADS_KEPT = 64


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
        fields = log_fields_start()
        try:
            response: HttpResponseBase = self.get_response(request)
        finally:
            log_fields_reset(fields)
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
        # One dict for the request: the sync code it runs in a thread (a copy of this
        # context) adds the principal to the same dict.
        fields = log_fields_start()
        try:
            get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]] = self.get_response
            response = await get_response(request)
        finally:
            log_fields_reset(fields)
            reset_request_id(token)
        response["X-Request-Id"] = request_id
        return response


# --- Django's own middlewares, without a thread hand-off per hook under ASGI ------------
#
# Under ASGI, Django's MiddlewareMixin runs each process_request and process_response in a
# thread (sync_to_async): two hand-offs per middleware, fifteen more for every API call, a
# poll included. The hooks of the middlewares below only read the request's headers and
# cookies and set response headers, so they run on the event loop; the cases that do
# I/O (saving a session or stored messages) still go to a thread, as Django sends them.
# console.asgi swaps them in for the classes settings.MIDDLEWARE names (ASGI_INLINE);
# under WSGI nothing changes.


class _InlineHooks(MiddlewareMixin):
    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self._inline_acall(request)
        return super().__call__(request)

    def _request_needs_thread(self, request: HttpRequest) -> bool:
        return False

    def _response_needs_thread(self, request: HttpRequest) -> bool:
        return False

    async def _inline_acall(self, request: HttpRequest) -> HttpResponseBase:
        response: HttpResponseBase | None = None
        process_request: Callable[..., Any] | None = getattr(self, "process_request", None)
        if process_request is not None:
            if self._request_needs_thread(request):
                response = await sync_to_async(process_request, thread_sensitive=True)(request)
            else:
                response = process_request(request)
        if response is None:
            response = await self.get_response(request)  # type: ignore[misc]
        assert response is not None
        process_response: Callable[..., Any] | None = getattr(self, "process_response", None)
        if process_response is not None:
            if self._response_needs_thread(request):
                call = sync_to_async(process_response, thread_sensitive=True)
                response = await call(request, response)
            else:
                response = process_response(request, response)
        assert response is not None
        return response


class SecurityMiddleware(_InlineHooks, security.SecurityMiddleware):
    pass


class SessionMiddleware(_InlineHooks, sessions_middleware.SessionMiddleware):
    def _response_needs_thread(self, request: HttpRequest) -> bool:
        # A session that is saved (and may be loaded first) is database work.
        session = getattr(request, "session", None)
        return session is not None and (
            session.modified or bool(settings.SESSION_SAVE_EVERY_REQUEST)
        )


class CommonMiddleware(_InlineHooks, common.CommonMiddleware):
    pass


class CsrfViewMiddleware(_InlineHooks, csrf.CsrfViewMiddleware):
    def __init__(self, get_response: Any) -> None:
        super().__init__(get_response)
        if self.async_mode:
            # Django hands a sync process_view to a thread; it reads this attribute after
            # __init__, so under ASGI it finds a coroutine function instead.
            self.process_view = self._process_view_async  # type: ignore[method-assign,assignment]

    # With CSRF_USE_SESSIONS the secret lives in the session (database work).
    def _request_needs_thread(self, request: HttpRequest) -> bool:
        return bool(settings.CSRF_USE_SESSIONS)

    def _response_needs_thread(self, request: HttpRequest) -> bool:
        return bool(settings.CSRF_USE_SESSIONS)

    async def _process_view_async(
        self, request: HttpRequest, callback: Any, args: Any, kwargs: Any
    ) -> HttpResponseBase | None:
        check = super().process_view
        # An exempt view (the API: bearer tokens) or a safe method is decided from the
        # headers alone; an unsafe one reads the form (request.POST) in a thread.
        exempt = getattr(callback, "csrf_exempt", False)
        if exempt or request.method in ("GET", "HEAD", "OPTIONS", "TRACE"):
            return check(request, callback, args, kwargs)
        return await sync_to_async(check, thread_sensitive=True)(request, callback, args, kwargs)


class AuthenticationMiddleware(_InlineHooks, auth_middleware.AuthenticationMiddleware):
    pass  # request.user stays lazy: nothing is read until a view asks


class MessageMiddleware(_InlineHooks, messages_middleware.MessageMiddleware):
    def _response_needs_thread(self, request: HttpRequest) -> bool:
        # Storing messages that were read or added may touch the session.
        storage = getattr(request, "_messages", None)
        return storage is not None and bool(storage.used or storage.added_new)


class XFrameOptionsMiddleware(_InlineHooks, clickjacking.XFrameOptionsMiddleware):
    pass


class CSPMiddleware(_InlineHooks, csp_middleware.CSPMiddleware):
    pass


# settings.MIDDLEWARE's name -> the subclass the ASGI handler loads instead.
ASGI_INLINE = {
    "django.middleware.security.SecurityMiddleware": SecurityMiddleware,
    "django.contrib.sessions.middleware.SessionMiddleware": SessionMiddleware,
    "django.middleware.common.CommonMiddleware": CommonMiddleware,
    "django.middleware.csrf.CsrfViewMiddleware": CsrfViewMiddleware,
    "django.contrib.auth.middleware.AuthenticationMiddleware": AuthenticationMiddleware,
    "django.contrib.messages.middleware.MessageMiddleware": MessageMiddleware,
    "django.middleware.clickjacking.XFrameOptionsMiddleware": XFrameOptionsMiddleware,
    "csp.middleware.CSPMiddleware": CSPMiddleware,
}


def asgi_middleware(names: list[str]) -> list[str]:
    """settings.MIDDLEWARE with the ASGI_INLINE classes' dotted paths swapped in."""
    return [
        f"{__name__}.{ASGI_INLINE[name].__name__}" if name in ASGI_INLINE else name
        for name in names
    ]


_P = ParamSpec("_P")
_R = TypeVar("_R")


class RequestExecutor(ThreadPoolExecutor):
    """A one-thread executor that knows whether work handed to it is still unfinished."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="request")
        self._unfinished = 0
        self._counting = threading.Lock()

    def submit(self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        with self._counting:
            self._unfinished += 1
        future = super().submit(fn, *args, **kwargs)
        # Added before the event loop's own callback (run_in_executor wraps the future
        # after submit returns): the count is down before an awaiting request resumes.
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: Future[Any]) -> None:
        with self._counting:
            self._unfinished -= 1

    @property
    def busy(self) -> bool:
        return self._unfinished > 0


class RequestThreads:
    """One-thread executors lent to requests one at a time, kept for the next request.

    Django's ASGIHandler gives each request a ThreadSensitiveContext with a new one-thread
    executor: its thread is started from the event loop (Thread.start waits until the thread
    runs) and, at the end, joined by yet another new thread — two thread starts a request,
    about half of the event loop's own time for an API call here, while every poll held by
    the process waits behind them. Reusing a thread for the next request is what a WSGI
    server does; the request's database connection is closed at its end either way
    (request_finished), so nothing of one request's is left for the next. A request that
    ended while its sync work still runs (its client went away, the task was cancelled)
    gives back a busy thread: that one is not kept, so that the next request does not queue
    behind work that is no longer anybody's; it ends when that work does. Used from the
    event loop's thread only."""

    def __init__(self, keep: int) -> None:
        self._idle: list[RequestExecutor] = []
        self.keep = keep  # idle executors kept at the most; a burst's extra ones are ended

    def borrow(self) -> RequestExecutor:
        if self._idle:
            return self._idle.pop()
        return RequestExecutor()

    def give_back(self, executor: RequestExecutor) -> None:
        if len(self._idle) < self.keep and not executor.busy:
            self._idle.append(executor)
        else:
            executor.shutdown(wait=False)

    @property
    def idle(self) -> int:
        return len(self._idle)


def request_threads_to_keep() -> int:
    """REQUEST_THREADS_KEPT when every database connection is closed at the end of its
    request (CONN_MAX_AGE 0; a pooled one then goes back to the pool), as in the web
    processes; else none: a kept thread would keep its persistent connection open too, one
    per kept thread, instead of one per request in flight."""
    closes = all(db.get("CONN_MAX_AGE", 0) == 0 for db in connections.settings.values())
    return REQUEST_THREADS_KEPT if closes else 0


class AirlockASGIHandler(ASGIHandler):
    """Django's ASGI handler (console.asgi's), loading the ASGI_INLINE subclasses in place
    of the middlewares settings.MIDDLEWARE names (which keeps Django's names for its checks),
    and running each request's sync work on a thread lent by RequestThreads."""

    def __init__(self) -> None:
        super().__init__()
        self.threads = RequestThreads(keep=request_threads_to_keep())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.threads.keep:
            # Django's own way (a thread a request), and its refusal of what is not HTTP.
            await super().__call__(scope, receive, send)
            return
        executor = self.threads.borrow()
        try:
            # The executor is this request's until the context exits; one still running
            # a sync call the request left behind is not lent again (give_back).
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        finally:
            self.threads.give_back(executor)

    def load_middleware(self, is_async: bool = False) -> None:
        declared = settings.MIDDLEWARE
        settings.MIDDLEWARE = asgi_middleware(declared)
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = declared
