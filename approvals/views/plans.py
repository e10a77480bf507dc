"""The plan page: a plan's approval and every step (diff, execution, compensation),
live while it runs."""

from __future__ import annotations

import uuid

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from approvals.models import Decision
from approvals.selectors import plan_detail, plans_visible_to
from approvals.views.plan_rows import plan_step_rows
from console.pages import console_page, is_htmx, pretty, render_fragment_or_page


@console_page
@require_GET
def plan_page(request: HttpRequest, plan_id: uuid.UUID) -> HttpResponse:
    """The whole page, or (htmx) its live part, which polls itself and is answered
    with 286 once the plan is final so the poll stops."""
    plan = get_object_or_404(plans_visible_to(request.user), pk=plan_id)
    detail = plan_detail(plan)
    approval = detail["approval"]
    decisions = list(approval.decisions.all()) if approval is not None else []
    context = {
        "nav": "runs",
        "plan": plan,
        "rows": plan_step_rows(detail["steps"], detail["conflicts"]),
        "approval": approval,
        "decisions": decisions,
        "approvals_so_far": sum(1 for d in decisions if d.decision == Decision.APPROVE),
        "error": pretty(plan.error) if plan.error else "",
    }
    response = render_fragment_or_page(request, "approvals/plan.html", context, partial="live")
    if is_htmx(request) and plan.is_final:
        response.status_code = 286  # htmx: stop polling
    return response
