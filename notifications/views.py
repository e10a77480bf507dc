"""The Notifications page (admins): subscriptions — add, pause, resume, test, rotate a
secret, delete — and the delivery log, which refreshes itself (htmx) without a reload."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET, require_POST

from audit.services import Actor
from console import permissions
from console.pages import (
    EditablePage,
    console_page,
    error_status,
    forbid_unless,
    form_errors_from,
    is_htmx,
    render_fragment_or_page,
)
from engine.core.errors import DomainError
from notifications.forms import SubscriptionForm
from notifications.selectors import delivery_list, subscription_list, subscriptions_reaching
from notifications.services import subscriptions as services

PAGE = EditablePage(
    template="notifications/page.html", url_name="notifications", event="notifications-changed"
)
_ADMINS = "The Notifications page is for admins."
LOG_SIZE = 50


def _context(
    request: HttpRequest, *, form: SubscriptionForm | None = None, secret: str = ""
) -> dict[str, Any]:
    return {
        "nav": "notifications",
        "subscriptions": subscription_list(),
        "form": form or SubscriptionForm(),
        "new_secret": secret,
        **_log_context(),
    }


def _log_context() -> dict[str, Any]:
    rows = delivery_list().select_related("subscription").order_by("-created_at", "-id")
    return {"deliveries": list(rows[:LOG_SIZE])}


def _admin(request: HttpRequest) -> Actor:
    forbid_unless(permissions.is_admin(request.user), _ADMINS)
    return Actor.person(request.user)


@console_page
@require_GET
def notifications_page(request: HttpRequest) -> HttpResponse:
    _admin(request)
    return render_fragment_or_page(request, PAGE.template, _context(request), partial="page")


@console_page
@require_GET
def delivery_log(request: HttpRequest) -> HttpResponse:
    """The log's fragment, polled by the page every few seconds."""
    _admin(request)
    return render(request, f"{PAGE.template}#log", _log_context())


@console_page
@require_POST
def subscription_create_view(request: HttpRequest) -> HttpResponse:
    actor = _admin(request)
    form = SubscriptionForm(request.POST)
    status, secret, notice = 422, "", ""
    if form.is_valid():
        try:
            created = services.subscription_create(actor=actor, **form.cleaned_data)
        except DomainError as exc:
            form_errors_from(form, exc)
            status = error_status(exc)
        else:
            status, secret = 200, created.secret
            notice = f"Subscription {created.subscription.pk} added."
    if status >= 400:
        return PAGE.respond(request, lambda: _context(request, form=form), status=status)
    # Rendered, not redirected: the secret is shown in this answer only.
    context = _context(request, secret=secret)
    context["page_notice"] = notice
    name = f"{PAGE.template}#page" if is_htmx(request) else PAGE.template
    response = render(request, name, context)
    response["Cache-Control"] = "no-store"
    return response


_VERBS = ("pause", "resume", "test", "rotate", "delete")


@console_page
@require_POST
def subscription_verb_view(request: HttpRequest, subscription_id: int, verb: str) -> HttpResponse:
    actor = _admin(request)
    if verb not in _VERBS:
        return PAGE.respond(request, lambda: _context(request), status=404)
    secret, notice = "", ""
    try:
        if verb in ("pause", "resume"):
            _, changed = services.subscription_update(
                actor=actor, subscription_id=subscription_id, paused=verb == "pause"
            )
            notice = f"Subscription {subscription_id} {verb}d." if changed else "Nothing changed."
        elif verb == "test":
            services.subscription_test(actor=actor, subscription_id=subscription_id)
            notice = f"Test event sent to subscription {subscription_id}: see the log."
        elif verb == "rotate":
            secret = services.subscription_secret_rotate(
                actor=actor, subscription_id=subscription_id
            ).secret
            notice = f"New secret for subscription {subscription_id}; the old one still signs."
        else:
            deleted = services.subscription_delete(actor=actor, subscription_id=subscription_id)
            notice = f"Subscription {subscription_id} {'deleted' if deleted else 'already gone'}."
    except DomainError as exc:
        return PAGE.respond(request, lambda: _context(request), status=error_status(exc))
    context = _context(request, secret=secret)
    context["page_notice"] = notice
    name = f"{PAGE.template}#page" if is_htmx(request) else PAGE.template
    response = render(request, name, context)
    response["Cache-Control"] = "no-store"
    response["HX-Trigger"] = '{"notifications-changed": true}'
    return response


@console_page
@require_GET
def my_notifications(request: HttpRequest) -> HttpResponse:
    """What reaches the signed-in person: any person may look at their own."""
    user = request.user
    context = {
        "nav": "notifications",
        "reaching": subscriptions_reaching(user),
        "email": getattr(user, "email", ""),
    }
    return render(request, "notifications/mine.html", context)
