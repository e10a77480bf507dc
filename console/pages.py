"""What every console page uses: sign-in, full page or htmx fragment, the answer
to a POST, errors from services, keyset pages.

Each view serves the full page and, for htmx requests, the fragment
(``"page.html#partial"``); every mutation also works as a plain form POST
with redirect-after-POST. A service's DomainError gets its status from the one
table in console/problems.py, as at the API.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.cache import patch_vary_headers

from console import permissions
from console.api_support import keyset_paginate, opaque_keyset
from console.problems import status_for_code
from console.requestctx import log_fields_add
from engine.core.errors import DomainError

V = TypeVar("V", bound=Callable[..., HttpResponseBase])

# Events fired through HX-Trigger after a mutation, so counters and lists refresh.
EVENT_COUNTS = "counts-changed"

PAGE_SIZE = 50


def console_page(view: V) -> V:
    """Login required, and the response varies on HX-Request (full page vs fragment)."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        log_fields_add(principal=f"person:{request.user.get_username()}")
        response = view(request, *args, **kwargs)
        patch_vary_headers(response, ("HX-Request",))
        return response

    return login_required(wrapper)  # type: ignore[return-value]


def signed_in(request: HttpRequest) -> User:
    """The signed-in person (console_page guarantees one)."""
    user = request.user
    if not isinstance(user, User):
        raise PermissionDenied("Sign in first.")
    return user


def forbid_unless(allowed: bool, why: str) -> None:
    if not allowed:
        raise PermissionDenied(why)


def forbid_unless_reader(request: HttpRequest, why: str) -> None:
    """A page for those who read everything (operators, admins, auditors)."""
    forbid_unless(permissions.can_read_everything(request.user), why)


def is_htmx(request: HttpRequest) -> bool:
    """An htmx request that wants a fragment (a history restore wants the whole page)."""
    htmx = getattr(request, "htmx", None)
    return htmx is not None and bool(htmx) and not htmx.history_restore_request


def _trigger(response: HttpResponse, events: Iterable[str]) -> HttpResponse:
    names = list(events)
    if names:
        response["HX-Trigger"] = json.dumps(dict.fromkeys(names, True))
    return response


def render_fragment_or_page(
    request: HttpRequest,
    template: str,
    context: dict[str, Any],
    *,
    partial: str,
    status: int = 200,
    trigger: Iterable[str] = (),
) -> HttpResponse:
    """The full page, or only ``template#partial`` for an htmx request."""
    name = f"{template}#{partial}" if is_htmx(request) else template
    return _trigger(render(request, name, context, status=status), trigger)


def after_post(
    request: HttpRequest,
    *,
    redirect_to: str,
    fragment: Callable[[], HttpResponse] | None = None,
    trigger: Iterable[str] = (EVENT_COUNTS,),
) -> HttpResponse:
    """Redirect-after-POST for plain forms; the updated fragment for htmx."""
    if is_htmx(request) and fragment is not None:
        response = fragment()
    else:
        response = HttpResponseRedirect(redirect_to)
    return _trigger(response, trigger)


def respond_page(
    request: HttpRequest,
    *,
    template: str,
    context: Callable[[], dict[str, Any]],
    redirect_to: str,
    notice: str = "",
    status: int = 200,
    events: Iterable[str] = (),
) -> HttpResponse:
    """The answer to a POST on a page whose body is the ``page`` partial.

    htmx: that partial (with the notice in place) and, on success, HX-Trigger.
    A plain form: redirect-after-POST on success, the whole page with its
    errors (same status) otherwise.
    """
    ok = status < 400
    if is_htmx(request):
        values = context()
        values["page_notice"] = notice if ok else ""
        response = render(request, f"{template}#page", values, status=status)
        return _trigger(response, events if ok else ())
    if ok:
        if notice:
            messages.success(request, notice)
        return HttpResponseRedirect(redirect_to)
    return render(request, template, context(), status=status)


@dataclass(frozen=True)
class EditablePage:
    """A page whose forms POST back to it: its template, its URL name (the
    redirect-after-POST) and the HX-Trigger event a change fires."""

    template: str
    url_name: str
    event: str

    def respond(
        self,
        request: HttpRequest,
        context: Callable[[], dict[str, Any]],
        *,
        notice: str = "",
        status: int = 200,
    ) -> HttpResponse:
        return respond_page(
            request,
            template=self.template,
            context=context,
            redirect_to=reverse(self.url_name),
            notice=notice,
            status=status,
            events=(self.event,),
        )

    def submit(
        self,
        request: HttpRequest,
        form: Any,
        save: Callable[[], str],
        context: Callable[..., dict[str, Any]],
        /,
        *,
        denied_as_page: bool = False,
        **kept: Any,
    ) -> HttpResponse:
        """A form POST: validate `form`, run `save` (one service call that returns the
        notice), answer with `respond`. On failure `kept` (the bound form, the row
        being edited) goes back into `context(request, **kept)` so the page shows the
        errors in place; a success renders the page afresh."""
        status, notice = _form_save(form, save, denied_as_page=denied_as_page)
        return self.respond(
            request,
            lambda: context(request, **(kept if status >= 400 else {})),
            notice=notice,
            status=status,
        )


def error_status(error: DomainError) -> int:
    """The HTTP status of a service's error on a page: the API's table (problems.py)."""
    return status_for_code(error.code)


def raise_if_denied(error: DomainError) -> None:
    """A service's 403/404 becomes the page's 403/404 (the same answer as a
    view's own check); any other error is the caller's to show in place."""
    status = error_status(error)
    if status == 403:
        raise PermissionDenied(error.message) from error
    if status == 404:
        raise Http404(error.message) from error


def form_errors_from(form: Any, error: DomainError) -> None:
    """Put a service's ValidationFailed field errors on the form's fields."""
    listed = error.extra.get("errors") if isinstance(error.extra, dict) else None
    if not listed:
        form.add_error(None, error.message)
        return
    for item in listed:
        field = item.get("field")
        form.add_error(field if field in form.fields else None, item.get("message", ""))


def _form_save(
    form: Any, save: Callable[[], str], *, denied_as_page: bool = False
) -> tuple[int, str]:
    """Returns (status, notice): 422 for an invalid form; a service's
    DomainError as its status with the message on the form (with `denied_as_page`,
    its 403/404 is the page's instead); otherwise 200 and the notice."""
    if not form.is_valid():
        return 422, ""
    try:
        return 200, save()
    except DomainError as exc:
        if denied_as_page:
            raise_if_denied(exc)
        form_errors_from(form, exc)
        return error_status(exc), ""


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


# --- keyset pages ----------------------------------------------------------------------


def keyset_page(
    queryset: Any,
    *,
    cursor: str | None,
    fields: tuple[str, str] = ("created_at", "id"),
    limit: int = PAGE_SIZE,
) -> tuple[list[Any], str | None]:
    """Newest first by `fields`: the API's pager, and a cursor it did not issue starts over."""
    keyset = opaque_keyset(fields)
    return keyset_paginate(queryset, keyset=keyset, cursor=cursor, limit=limit, lenient=True)


def query_without(request: HttpRequest, key: str) -> str:
    """The current query string without `key` (for "next page" links keeping filters)."""
    params = request.GET.copy()
    params.pop(key, None)
    return params.urlencode()


def render_list_page(
    request: HttpRequest,
    template: str,
    queryset: Any,
    context: dict[str, Any],
    *,
    rows: str,
    fields: tuple[str, str] = ("created_at", "id"),
    page_context: Callable[[list[Any]], dict[str, Any]] | None = None,
) -> HttpResponse:
    """A filtered list, newest first by `fields`: one keyset page of `queryset` as
    `rows`, the next page's cursor and the query string without it (the "next" link
    keeps the filters); the whole page, or its ``list`` partial for htmx. The
    template's link: console/partials/_list_pager.html. `page_context(rows)`: what the
    page's rows alone need (one query for the page, not for the whole list)."""
    page, next_cursor = keyset_page(queryset, cursor=request.GET.get("cursor"), fields=fields)
    return render_fragment_or_page(
        request,
        template,
        {
            **context,
            **(page_context(page) if page_context is not None else {}),
            rows: page,
            "next_cursor": next_cursor,
            "query": query_without(request, "cursor"),
        },
        partial="list",
    )
