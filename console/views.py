"""Console pages: sign-in, the dashboard and the kill switch."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from approvals.models import Action, ActionStatus
from approvals.selectors import (
    actions_visible_to,
    pending_approval_count,
    plans_visible_to,
    run_list_for_actor,
)
from approvals.services.grants import grants_saved_since
from audit.models import AuditEvent
from audit.services import Actor
from console import permissions
from console.forms import KillSwitchForm
from console.models import KillSwitch
from console.pages import (
    after_post,
    console_page,
    error_status,
    is_htmx,
    render_fragment_or_page,
)
from console.services import kill_switch_set
from engine.core.errors import DomainError
from ownership.models import ConflictStatus
from ownership.selectors import conflict_list_for_person, open_conflict_count, resource_list

# --- sign-in -------------------------------------------------------------------


class LoginView(auth_views.LoginView):
    """Django's login; django-axes counts failures and locks a username out from one
    client address, console/login_throttle.py throttles the address and slows a username
    attacked from many (docs/login-throttling.md)."""

    template_name = "registration/login.html"
    redirect_authenticated_user = True
    extra_context = {"failure_limit": settings.AXES_FAILURE_LIMIT}


class LogoutView(auth_views.LogoutView):
    pass


# --- dashboard -----------------------------------------------------------------


def dashboard_counts(user: Any) -> dict[str, Any]:
    """The live numbers on the dashboard: one aggregate over the live action
    statuses (index on status) plus three counts through the selectors."""
    hour_ago = timezone.now() - timedelta(hours=1)
    actions = Action.objects.filter(
        Q(status__in=[ActionStatus.QUEUED, ActionStatus.EXECUTING, ActionStatus.PAUSED])
        | Q(status=ActionStatus.FAILED, updated_at__gte=hour_ago)
    ).aggregate(
        queued=Count("id", filter=Q(status=ActionStatus.QUEUED)),
        executing=Count("id", filter=Q(status=ActionStatus.EXECUTING)),
        paused=Count("id", filter=Q(status=ActionStatus.PAUSED)),
        failed_last_hour=Count("id", filter=Q(status=ActionStatus.FAILED)),
    )

    conflicts_all = conflict_list_for_person(user, status=ConflictStatus.OPEN).count()
    pending = pending_approval_count(user)
    may_decide = permissions.can_decide_approvals(user)
    return {
        "pending_approvals": pending,
        "may_decide": may_decide,
        "conflicts_mine": open_conflict_count(user),
        "conflicts_all": conflicts_all,
        # Per-call writes a person's standing grant admitted instead of a decision.
        "grant_saved_week": grants_saved_since(timezone.now() - timedelta(days=7)),
        **actions,
    }


def dashboard_context(request: HttpRequest, form: KillSwitchForm | None = None) -> dict[str, Any]:
    user = request.user
    reader = permissions.can_read_everything(user)
    pauses = (
        Action.objects.filter(status=ActionStatus.PAUSED)
        .values("paused_reason")
        .annotate(n=Count("id"))
        .order_by("-n")[:10]
    )
    return {
        "nav": "dashboard",
        "counts": dashboard_counts(user),
        "pauses": list(pauses),
        "switches": list(KillSwitch.objects.select_related("changed_by").order_by("scope")[:50]),
        "may_switch": permissions.is_operator(user),
        "form": form or KillSwitchForm(),
        "recent": list(AuditEvent.objects.order_by("-seq")[:12]) if reader else None,
    }


@console_page
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "console/dashboard.html", dashboard_context(request))


@console_page
@require_GET
def dashboard_counts_fragment(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "console/dashboard.html#counts",
        {"counts": dashboard_counts(request.user)},
    )


@console_page
@require_GET
def nav_count(request: HttpRequest, what: str) -> HttpResponse:
    """A badge in the navigation: approvals waiting for me, or conflicts I may resolve."""

    if what == "approvals":
        count, label = pending_approval_count(request.user), "waiting for you"
    elif what == "conflicts":
        count, label = open_conflict_count(request.user), "for you to resolve"
    else:
        raise Http404("No such counter")
    return render(
        request,
        "console/partials/_nav_count.html",
        {"what": what, "count": count, "label": label},
    )


@console_page
@require_GET
def killswitch_banner(request: HttpRequest) -> HttpResponse:
    return render(request, "console/partials/_banner.html")


@console_page
@require_POST
def killswitch_set(request: HttpRequest) -> HttpResponse:
    """Engage or release one scope (operators and admins; audited by the service)."""
    if not permissions.is_operator(request.user):
        raise PermissionDenied("Only operators and admins may use the kill switch.")
    form = KillSwitchForm(request.POST)
    if not form.is_valid():
        context = dashboard_context(request, form)
        return render_fragment_or_page(
            request, "console/dashboard.html", context, partial="killswitch", status=422
        )

    data = form.cleaned_data
    engaged = data["action"] == "engage"
    try:
        kill_switch_set(
            scope=data["scope"],
            engaged=engaged,
            reason=data["reason"],
            actor=Actor.person(request.user),
        )
    except DomainError as error:
        form.add_error(None, error.message)
        context = dashboard_context(request, form)
        return render_fragment_or_page(
            request,
            "console/dashboard.html",
            context,
            partial="killswitch",
            status=error_status(error),
        )
    verb = "engaged" if engaged else "released"
    notice = f"Kill switch {verb} for {data['scope']}."
    if not is_htmx(request):
        # The redirect's page shows it; an htmx swap shows it in the card it replaced
        # (a flash message there would wait for whatever page is visited next).
        messages.success(request, notice)
    return after_post(
        request,
        redirect_to=reverse("dashboard"),
        fragment=lambda: render(
            request,
            "console/dashboard.html#killswitch",
            {**dashboard_context(request), "page_notice": notice},
        ),
    )


# --- global search ----------------------------------------------------------------

SEARCH_LIMIT = 10
_HEX = frozenset("0123456789abcdef")


def uuid_prefix_range(text: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The ids that start with `text` (hex, dashes ignored, at least 4 digits) as a
    closed range of UUIDs: a prefix search that the primary key's index answers."""
    digits = text.lower().replace("-", "")
    if not 4 <= len(digits) <= 32 or not set(digits) <= _HEX:
        return None
    return (
        uuid.UUID(digits.ljust(32, "0")),
        uuid.UUID(digits.ljust(32, "f")),
    )


def _by_id(queryset: Any, text: str) -> list[Any]:
    bounds = uuid_prefix_range(text)
    if bounds is None:
        return []
    return list(queryset.filter(pk__range=bounds).order_by("pk")[:SEARCH_LIMIT])


def search_results(user: Any, text: str) -> dict[str, list[Any]]:
    """What `text` finds among what `user` may read: runs (id, agent name), actions (id),
    plans (id), resources (kind/name or a part of the name), conflicts (id)."""
    runs = run_list_for_actor(user)
    found_runs = _by_id(runs, text)
    if not found_runs:
        found_runs = list(runs.filter(agent__name__iexact=text).order_by("-created_at")[:10])
    kind, _, name = text.partition("/")
    resources = resource_list().only("id", "kind_id", "name", "version", "deleted")
    if name:
        by_name = resources.filter(kind_id=kind, name__startswith=name)
    else:
        by_name = resources.filter(name__icontains=text)
    return {
        "runs": found_runs,
        "actions": _by_id(actions_visible_to(user).select_related("agent"), text),
        "plans": _by_id(plans_visible_to(user), text),
        "resources": list(by_name.order_by("kind_id", "name")[:SEARCH_LIMIT]),
        "conflicts": _by_id(conflict_list_for_person(user), text),
    }


_RESULT_PAGES = {
    "runs": "run_detail",
    "actions": "action_detail",
    "plans": "plan_detail",
    "conflicts": "conflict_detail",
}


@console_page
@require_GET
def search(request: HttpRequest) -> HttpResponse:
    """The header's search box: a run, action, plan, conflict or resource by id (full or
    a prefix of at least 4 hex digits) or name. One match for a full id opens its page."""
    text = request.GET.get("q", "").strip()[:200]
    results = search_results(request.user, text) if text else {}
    found = [(group, item) for group, items in results.items() for item in items]
    if len(found) == 1 and len(text.replace("-", "")) == 32:
        group, item = found[0]
        if group == "resources":
            return redirect("resource_detail", item.identifier)
        return redirect(_RESULT_PAGES[group], item.pk)
    return render(
        request,
        "console/search.html",
        {
            "nav": "search",
            "q": text,
            "results": results,
            "count": len(found),
            "limit": SEARCH_LIMIT,
        },
    )
