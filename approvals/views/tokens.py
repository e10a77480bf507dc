"""Tokens: personal tokens for everyone; agents and their tokens for admins."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib import messages
from django.db.models import Prefetch
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from approvals.forms import AgentCreateForm, AgentTokenCreateForm, PersonalTokenCreateForm
from approvals.models import Agent, AgentToken, PersonalToken
from approvals.services import tokens as token_services
from approvals.services.tokens import token_revoke
from audit.services import Actor
from console import permissions
from console.pages import (
    console_page,
    error_status,
    forbid_unless,
    form_errors_from,
    is_htmx,
    raise_if_denied,
    render_fragment_or_page,
    signed_in,
)
from engine.core.errors import DomainError


def _tokens_context(request: HttpRequest, **extra: Any) -> dict[str, Any]:
    user = request.user
    admin = permissions.is_admin(user)
    return {
        "nav": "tokens",
        "personal_tokens": list(
            PersonalToken.objects.filter(user=signed_in(request)).order_by("-created_at")[:100]
        ),
        "personal_form": PersonalTokenCreateForm(),
        "is_admin": admin,
        "agents": list(
            Agent.objects.select_related("owner")
            .prefetch_related(
                Prefetch("tokens", queryset=AgentToken.objects.order_by("-created_at"))
            )
            .order_by("name")[:200]
        )
        if admin
        else [],
        "agent_form": AgentCreateForm(),
        "agent_token_form": AgentTokenCreateForm(),
        "now": timezone.now(),
        **extra,
    }


EVENT_TOKENS = "tokens-changed"
TOKENS_TEMPLATE = "approvals/tokens.html"


def _tokens_render(
    request: HttpRequest, *, status: int = 200, notice: str = "", **extra: Any
) -> HttpResponse:
    """The tokens page, or its ``page`` fragment for htmx (HX-Trigger on success)."""
    htmx = is_htmx(request)
    context = _tokens_context(request, page_notice=notice if htmx else "", **extra)
    name = f"{TOKENS_TEMPLATE}#page" if htmx else TOKENS_TEMPLATE
    response = render(request, name, context, status=status)
    if htmx and status < 400:
        response["HX-Trigger"] = json.dumps({EVENT_TOKENS: True})
    return response


@console_page
@require_GET
def tokens_page(request: HttpRequest) -> HttpResponse:
    return render_fragment_or_page(
        request, TOKENS_TEMPLATE, _tokens_context(request), partial="page"
    )


def _show_secret(request: HttpRequest, *, what: str, secret: str) -> HttpResponse:
    # Shown once, never stored in clear: rendered directly, not through a redirect.
    response = _tokens_render(request, new_secret=secret, new_secret_what=what)
    response["Cache-Control"] = "no-store"
    return response


def _after_revoke(request: HttpRequest, notice: str) -> HttpResponse:
    if is_htmx(request):
        return _tokens_render(request, notice=notice)
    messages.success(request, notice)
    return HttpResponseRedirect(reverse("tokens"))


def _revoke(request: HttpRequest, token: AgentToken | PersonalToken) -> bool:
    try:
        return token_revoke(token=token, actor=Actor.person(request.user))
    except DomainError as exc:
        raise_if_denied(exc)
        raise


@console_page
@require_POST
def personal_token_create(request: HttpRequest) -> HttpResponse:
    form = PersonalTokenCreateForm(request.POST)
    if not form.is_valid():
        return _tokens_render(request, status=422, personal_form=form)
    token, secret = token_services.personal_token_create(
        user=request.user, label=form.cleaned_data["label"], actor=Actor.person(request.user)
    )
    return _show_secret(request, what=f"personal token {token.prefix}…", secret=secret)


@console_page
@require_POST
def personal_token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    token = PersonalToken.objects.filter(pk=token_id, user=signed_in(request)).first()
    if token is None:
        raise Http404("No such token")

    changed = _revoke(request, token)
    verb = "revoked" if changed else "was already revoked"
    return _after_revoke(request, f"Token {token.prefix}… {verb}.")


@console_page
@require_POST
def agent_create(request: HttpRequest) -> HttpResponse:
    form = AgentCreateForm(request.POST)
    if not form.is_valid():
        forbid_unless(permissions.is_admin(request.user), "Only admins create agents.")
        return _tokens_render(request, status=422, agent_form=form)
    try:
        agent, secret = token_services.agent_create(
            name=form.cleaned_data["name"],
            description=form.cleaned_data["description"],
            owner=form.cleaned_data["owner"],
            actor=Actor.person(request.user),
        )
    except DomainError as exc:
        raise_if_denied(exc)
        form_errors_from(form, exc)
        return _tokens_render(request, status=error_status(exc), agent_form=form)
    return _show_secret(request, what=f"agent token for {agent.name}", secret=secret)


@console_page
@require_POST
def agent_token_create(request: HttpRequest, agent_id: uuid.UUID) -> HttpResponse:
    # The page's own 403 first: an outsider learns nothing about which agents exist.
    forbid_unless(permissions.is_admin(request.user), "Only admins create agent tokens.")
    agent = get_object_or_404(Agent, pk=agent_id)
    form = AgentTokenCreateForm(request.POST)
    if not form.is_valid():
        return _tokens_render(
            request, status=422, agent_token_form=form, agent_token_error_for=agent.pk
        )
    try:
        _token, secret = token_services.agent_token_create(
            agent=agent, label=form.cleaned_data["label"], actor=Actor.person(request.user)
        )
    except DomainError as exc:
        raise_if_denied(exc)
        raise
    return _show_secret(request, what=f"agent token for {agent.name}", secret=secret)


@console_page
@require_POST
def agent_token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    forbid_unless(permissions.is_admin(request.user), "Only admins revoke agent tokens.")
    token = get_object_or_404(AgentToken, pk=token_id)
    changed = _revoke(request, token)
    verb = "revoked" if changed else "was already revoked"
    return _after_revoke(request, f"Agent token {token.prefix}… {verb}.")
