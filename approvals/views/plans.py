"""The plan page: a plan's approval and every step (diff, execution, compensation),
live while it runs; a person may approve or reject the plan from it."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from approvals.forms import DecisionForm
from approvals.models import Approval, ApprovalStatus, Decision, Plan
from approvals.selectors import approval_get_for_person, plan_detail, plans_visible_to
from approvals.services.decisions import approval_decide
from approvals.services.separation import approvals_forbidding_self
from approvals.views.inbox import EVENT_APPROVALS
from approvals.views.plan_rows import plan_step_rows
from audit.services import Actor
from console import permissions
from console.pages import (
    EVENT_COUNTS,
    console_page,
    error_status,
    is_htmx,
    pretty,
    render_fragment_or_page,
)
from engine.core.errors import DomainError, NotFound


def _may_decide(request: HttpRequest, approval: Approval | None, voted: bool) -> bool:
    """Offer the decision form where approval_decide would accept it: a pending
    approval, the operator role, no vote yet, and separation of duties (the run's
    token minter is kept out). The service checks all of it again."""
    if approval is None or approval.status != ApprovalStatus.PENDING or voted:
        return False
    if not permissions.can_decide_approvals(request.user):
        return False
    kept_out = approvals_forbidding_self(approvals=[approval], actor=Actor.person(request.user))
    return approval.pk not in kept_out


def _plan_context(request: HttpRequest, plan: Plan, **extra: Any) -> dict[str, Any]:
    detail = plan_detail(plan)
    approval = detail["approval"]
    decisions = list(approval.decisions.all()) if approval is not None else []
    mine = next((d for d in decisions if d.person_id == request.user.pk), None)
    return {
        "nav": "runs",
        "plan": plan,
        "rows": plan_step_rows(detail["steps"], detail["conflicts"]),
        "approval": approval,
        "decisions": decisions,
        "my_decision": mine,
        "may_decide": _may_decide(request, approval, mine is not None),
        "form": DecisionForm(),
        "is_operator": permissions.can_decide_approvals(request.user),
        "approvals_so_far": sum(1 for d in decisions if d.decision == Decision.APPROVE),
        "error": pretty(plan.error) if plan.error else "",
        **extra,
    }


@console_page
@require_GET
def plan_page(request: HttpRequest, plan_id: uuid.UUID) -> HttpResponse:
    """The whole page, or (htmx) its live part, which polls itself and is answered
    with 286 once the plan is final so the poll stops."""
    plan = get_object_or_404(plans_visible_to(request.user), pk=plan_id)
    context = _plan_context(request, plan)
    response = render_fragment_or_page(request, "approvals/plan.html", context, partial="live")
    if is_htmx(request) and plan.is_final:
        response.status_code = 286  # htmx: stop polling
    return response


@console_page
@require_POST
def plan_decide_view(request: HttpRequest, plan_id: uuid.UUID) -> HttpResponse:
    """Approve or reject a plan from its own page: the inbox's decision (the same
    service: separation of duties, quorum, one vote per person), answered in place."""
    user = request.user
    plan = get_object_or_404(plans_visible_to(user), pk=plan_id)
    approval = Approval.objects.filter(plan=plan).order_by("-created_at").first()
    if approval is None:
        raise Http404("This plan has no approval of its own.")
    try:
        approval_get_for_person(user, approval.pk)
    except NotFound as exc:
        raise Http404(exc.message) from exc
    form = DecisionForm(request.POST)
    error: str | None = None
    status = 200
    if form.is_valid():
        try:
            approval_decide(
                approval_id=approval.pk,
                actor=Actor.person(user),
                decision=form.cleaned_data["decision"],
                comment=form.cleaned_data["comment"],
            )
        except DomainError as exc:
            error = exc.message
            status = error_status(exc)
    else:
        error = "; ".join(str(e) for errors in form.errors.values() for e in errors)
        status = 422
    plan.refresh_from_db()
    if is_htmx(request):
        context = _plan_context(request, plan, decision_error=error)
        response = render_fragment_or_page(
            request, "approvals/plan.html", context, partial="live", status=status
        )
        if error is None:
            response["HX-Trigger"] = json.dumps({EVENT_COUNTS: True, EVENT_APPROVALS: True})
        return response
    if error is None:
        messages.success(request, "Your decision on the plan is recorded.")
    else:
        messages.error(request, error)
    return HttpResponseRedirect(reverse("plan_detail", args=[plan.pk]))
