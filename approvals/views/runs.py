"""Runs and actions: filtered run list, run timeline and revoke, action detail and status."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib import messages
from django.db.models import Exists, OuterRef, Prefetch
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from approvals.forms import RevokeForm, RunFilterForm
from approvals.models import Action, ApprovalDecision, PlanStep, Run, RunStatus
from approvals.selectors import actions_visible_to, plans_visible_to, run_list_for_actor
from approvals.services.runs import run_revoke
from audit.services import Actor
from console import permissions
from console.pages import (
    EVENT_COUNTS,
    console_page,
    error_status,
    forbid_unless,
    is_htmx,
    pretty,
    render_fragment_or_page,
    render_list_page,
)
from engine.core.errors import DomainError
from ownership.models import OwnershipRecord

# --- actions ---------------------------------------------------------------------------


def _action_for(user: Any, action_id: uuid.UUID) -> Action:
    # The grant (and its owner) that admitted the write, named on the action page.
    related = ("run", "agent", "resource", "conflict_class", "grant__owner")
    return get_object_or_404(actions_visible_to(user).select_related(*related), pk=action_id)


@console_page
@require_GET
def action_detail(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    action = _action_for(request.user, action_id)
    operations = list(action.operations.order_by("started_at"))
    conflicts = list(action.conflicts.all())
    approvals = list(
        action.approvals.prefetch_related(
            Prefetch("decisions", queryset=ApprovalDecision.objects.select_related("person"))
        )
    )
    context = {
        "nav": "runs",
        "action": action,
        "operations": operations,
        "conflicts": conflicts,
        "approvals": approvals,
        # A step of a plan: the page links the plan it belongs to.
        "plan_step": PlanStep.objects.filter(action=action).select_related("plan").first(),
        "children": list(action.children.all()[:20]),
        "payload": pretty(action.payload) if action.payload is not None else "(none)",
        "error": pretty(action.error) if action.error else "",
    }
    return render(request, "approvals/action.html", context)


@console_page
@require_GET
def action_status(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    """A status badge that polls itself until the action is final (then answers 286)."""
    action = _action_for(request.user, action_id)
    response = render(request, "approvals/partials/_action_status.html", {"action": action})
    if action.is_final and is_htmx(request):
        response.status_code = 286  # htmx: stop polling
    return response


# --- runs ---------------------------------------------------------------------------------


@console_page
@require_GET
def runs_list(request: HttpRequest) -> HttpResponse:
    form = RunFilterForm(request.GET or None)
    runs = run_list_for_actor(request.user).select_related("agent")
    if form.is_valid():
        data = form.cleaned_data
        if data.get("status"):
            runs = runs.filter(status=data["status"])
        if data.get("agent"):
            runs = runs.filter(agent__name=data["agent"])
        if data.get("action_status"):
            runs = runs.filter(
                Exists(Action.objects.filter(run=OuterRef("pk"), status=data["action_status"]))
            )
    context = {
        "nav": "runs",
        "form": form if form.is_bound else RunFilterForm(),
        "now": timezone.now(),
    }
    return render_list_page(request, "approvals/runs.html", runs, context, rows="runs")


def _run_for(user: Any, run_id: uuid.UUID) -> Run:
    return get_object_or_404(run_list_for_actor(user).select_related("agent"), pk=run_id)


def _run_context(request: HttpRequest, run: Run) -> dict[str, Any]:
    actions = list(
        run.actions.select_related("conflict_class", "resource").order_by("-created_at")[:100]
    )
    plans = list(plans_visible_to(request.user).filter(run=run).order_by("-created_at")[:50])
    records = list(OwnershipRecord.objects.filter(run=run).order_by("-active", "kind_id", "name"))
    now = timezone.now()
    heartbeat_age = (
        int((now - run.last_heartbeat_at).total_seconds()) if run.last_heartbeat_at else None
    )
    return {
        "nav": "runs",
        "run": run,
        "actions": actions,
        "plans": plans,
        "records": [r for r in records if not r.exclusive],
        "leases": [r for r in records if r.exclusive],
        "heartbeat_age": heartbeat_age,
        "now": now,
        "may_revoke": permissions.is_operator(request.user)
        and run.status in (RunStatus.ACTIVE, RunStatus.PENDING_APPROVAL),
        "is_operator": permissions.is_operator(request.user),
        "revoke_form": RevokeForm(),
    }


@console_page
@require_GET
def run_detail(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    run = _run_for(request.user, run_id)
    context = _run_context(request, run)
    response = render_fragment_or_page(request, "approvals/run.html", context, partial="timeline")
    ended = run.status not in (RunStatus.ACTIVE, RunStatus.PENDING_APPROVAL)
    settled = all(a.is_final for a in context["actions"]) and all(
        p.is_final for p in context["plans"]
    )
    if is_htmx(request) and ended and settled:
        response.status_code = 286  # htmx: nothing will change any more, stop polling
    return response


@console_page
@require_POST
def run_revoke_view(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    run = _run_for(request.user, run_id)
    forbid_unless(permissions.is_operator(request.user), "Revoking a run needs the operator role.")
    form = RevokeForm(request.POST)

    def respond(*, notice: str = "", error: str = "", status: int = 200) -> HttpResponse:
        if is_htmx(request):
            context = _run_context(request, run)
            context.update(revoke_form=form, revoke_error=error, page_notice=notice)
            response = render(request, "approvals/run.html#page", context, status=status)
            if not error and status == 200:
                response["HX-Trigger"] = json.dumps({EVENT_COUNTS: True})
            return response
        if status == 422:
            context = _run_context(request, run)
            context["revoke_form"] = form
            return render(request, "approvals/run.html", context, status=422)
        (messages.error if error else messages.success)(request, error or notice)
        return HttpResponseRedirect(reverse("run_detail", args=[run.id]))

    if not form.is_valid():
        return respond(status=422)
    try:
        run_revoke(run=run, actor=Actor.person(request.user), reason=form.cleaned_data["reason"])
    except DomainError as exc:
        return respond(error=exc.message, status=error_status(exc))
    run.refresh_from_db()
    return respond(notice="Run revoked: its ownership records are released.")
