"""The approvals inbox: pending approvals with their diff, live arrivals, one decision at a time."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.db.models import Prefetch, Q
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_GET, require_POST

from approvals.forms import DecisionForm
from approvals.models import Approval, ApprovalDecision, ApprovalStatus, PlanStep
from approvals.selectors import approval_get_for_person, approval_list_for_person
from approvals.services.decisions import (
    APPROVE_WITH_EDITS,
    approval_decide,
    approval_decide_tallied,
)
from approvals.services.separation import approvals_forbidding_self
from approvals.views.plan_rows import plan_step_rows
from audit.services import Actor
from console import permissions
from console.core import jsonsafe
from console.core.errors import DomainError, NotFound
from console.pages import EVENT_COUNTS, console_page, error_status, is_htmx, render_fragment_or_page
from ownership.diff import document_diff_view, proposed_document

EVENT_APPROVALS = "approvals-changed"
INBOX_PAGE = 25


def _approval_rows(approvals: list[Approval], user: Any) -> list[dict[str, Any]]:
    # Separation of duties: no decision is offered where the person would be refused.
    kept_out = approvals_forbidding_self(approvals=approvals, actor=Actor.person(user))
    rows = []
    for approval in approvals:
        decisions = list(approval.decisions.all())
        row: dict[str, Any] = {
            "approval": approval,
            "decisions": decisions,
            "approvals_so_far": sum(1 for d in decisions if d.decision == "approve"),
            "self_approval": approval.pk in kept_out,
        }
        if approval.plan_id is not None:
            # One card for the whole plan: every step against the document now.
            steps = PlanStep.objects.filter(plan_id=approval.plan_id).order_by("position")
            row["plan_steps"] = plan_step_rows(list(steps.select_related("applied_operation")))
        action = approval.action
        if action is not None:
            current = action.resource
            row["current_version"] = current.token if current else None
            row["version_moved"] = (
                current is not None
                and action.observed_version is not None
                and current.token != action.observed_version
            )
            before = current.document if current and not current.deleted else {}
            row["diff"] = document_diff_view(
                before,
                proposed_document(action, before),
                before_label="Current",
                after_label="Proposed",
            )
            # Approve with edits: the proposed document (a PATCH's merge patch), prefilled.
            row["editable"] = action.operation != "delete"
            row["edit_text"] = json.dumps(action.payload, indent=2, ensure_ascii=False)
        rows.append(row)
    return rows


def _approvals_for(user: Any, *, status: str | None = ApprovalStatus.PENDING) -> Any:
    """The engine's selector: approvals this person may decide, oldest first."""
    return (
        approval_list_for_person(user, status=status)
        .select_related("action__agent", "plan")
        .prefetch_related(
            Prefetch("decisions", queryset=ApprovalDecision.objects.select_related("person"))
        )
    )


@console_page
@require_GET
def approvals_inbox(request: HttpRequest) -> HttpResponse:
    user = request.user
    # Oldest first: the one waiting longest is decided first.
    qs = _approvals_for(user).order_by("created_at", "id")
    cursor = _uuid_or_none(request.GET.get("after") or "")
    if cursor is not None:
        pivot = Approval.objects.only("created_at").filter(pk=cursor).first()
        if pivot is not None:
            qs = qs.filter(
                Q(created_at__gt=pivot.created_at) | Q(created_at=pivot.created_at, id__gt=pivot.id)
            )
    approvals = list(qs[: INBOX_PAGE + 1])
    next_cursor = None
    if len(approvals) > INBOX_PAGE:
        approvals = approvals[:INBOX_PAGE]
        next_cursor = str(approvals[-1].id)
    context = {
        "nav": "approvals",
        "rows": _approval_rows(approvals, user),
        "may_decide": True,
        "is_operator": permissions.can_decide_approvals(user),
        "next_cursor": next_cursor,
        "form": DecisionForm(),
        # The last page polls for approvals that arrive while it is open.
        "poll_query": None if next_cursor else _poll_query(approvals, since=timezone.now()),
    }
    return render_fragment_or_page(request, "approvals/inbox.html", context, partial="list")


# A row can commit a little after a later-created one (created_at is set at
# insert time): the poll looks back this far and skips the ids the page shows.
POLL_LOOKBACK = timedelta(seconds=120)
POLL_BATCH = 20


def _poll_query(shown: list[Approval], *, since: datetime) -> str:
    """The poller's query string: the newest time seen and the ids shown within
    the look-back window before it (so nothing is missed and nothing shown twice)."""
    newest = max([since, *(a.created_at for a in shown)])
    recent = sorted(str(a.id) for a in shown if a.created_at > newest - POLL_LOOKBACK)
    return urlencode({"since": newest.isoformat(), "seen": ",".join(recent)})


@console_page
@require_GET
def approvals_poll(request: HttpRequest) -> HttpResponse:
    """New pending approvals for an open inbox, appended out of band without
    touching the cards already on the page (a comment being typed survives).

    204 (htmx: no swap) when nothing is new; otherwise the new cards plus a
    fresh poller carrying the advanced cursor, and HX-Trigger for the counters.
    """
    since = parse_datetime(request.GET.get("since") or "")
    if since is None or timezone.is_naive(since):
        return HttpResponse("Bad poll cursor", status=400, content_type="text/plain")
    seen = [u for u in (_uuid_or_none(v) for v in request.GET.get("seen", "").split(",")) if u]
    fresh = list(
        _approvals_for(request.user)
        .filter(created_at__gt=since - POLL_LOOKBACK)
        .exclude(pk__in=seen[:500])
        .order_by("created_at", "id")[:POLL_BATCH]
    )
    if not fresh:
        return HttpResponse(status=204)
    # Keep the ids still inside the window: those already shown and these new ones.
    still_recent = list(
        Approval.objects.filter(pk__in=seen[:500], created_at__gt=since - POLL_LOOKBACK)
    )
    context = {
        "rows": _approval_rows(fresh, request.user),
        "may_decide": True,
        "poll_query": _poll_query([*still_recent, *fresh], since=since),
    }
    response = render(request, "approvals/inbox.html#poll_news", context)
    response["HX-Trigger"] = json.dumps({EVENT_COUNTS: True})
    return response


def _uuid_or_none(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


@console_page
@require_POST
def approval_decide_view(request: HttpRequest, approval_id: uuid.UUID) -> HttpResponse:
    """One decision on one approval; there is deliberately no bulk variant."""

    user = request.user
    try:
        approval = approval_get_for_person(user, approval_id)
    except NotFound as exc:
        raise Http404(exc.message) from exc
    form = DecisionForm(request.POST)
    error: str | None = None
    status = 200
    if form.is_valid():
        try:
            approval_decide(
                approval_id=approval.id,
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

    def fragment() -> HttpResponse:
        fresh = _approvals_for(user, status=None).get(pk=approval.pk)
        context = {"row": _approval_rows([fresh], user)[0], "may_decide": True, "error": error}
        return render(request, "approvals/inbox.html#approval", context, status=status)

    if is_htmx(request):
        response = fragment()
        if error is None:
            response["HX-Trigger"] = json.dumps({EVENT_COUNTS: True, EVENT_APPROVALS: True})
        return response
    if error is None:
        messages.success(request, "Decision recorded.")
    else:
        messages.error(request, error)
    return HttpResponseRedirect(reverse("approvals"))


@console_page
@require_POST
def approval_edit_view(request: HttpRequest, approval_id: uuid.UUID) -> HttpResponse:
    """Approve with edits from a call approval's card: the edited document (JSON, through
    the one parser) and a comment. Errors are shown in the card, the text kept as typed."""
    user = request.user
    try:
        approval = approval_get_for_person(user, approval_id)
    except NotFound as exc:
        raise Http404(exc.message) from exc
    text = request.POST.get("document", "")
    error: str | None = None
    status = 200
    try:
        document = jsonsafe.loads(text, field="document")
        approval_decide_tallied(
            approval_id=approval.id,
            actor=Actor.person(user),
            person=user,
            decision=APPROVE_WITH_EDITS,
            comment=request.POST.get("comment", ""),
            edit={"document": document},
        )
    except DomainError as exc:
        error = _edit_error(exc)
        status = error_status(exc) if exc.code != "validation_error" else 422

    fresh = _approvals_for(user, status=None).get(pk=approval.pk)
    row = _approval_rows([fresh], user)[0]
    if error is not None:
        row["edit_text"], row["edit_open"] = text, True
    context: dict[str, Any] = {"row": row, "may_decide": True, "error": error}
    if is_htmx(request):
        response = render(request, "approvals/inbox.html#approval", context, status=status)
        if error is None:
            response["HX-Trigger"] = json.dumps({EVENT_COUNTS: True, EVENT_APPROVALS: True})
        return response
    if error is None:
        messages.success(
            request, "Approved with your edits: the edited write replaces the agent's."
        )
        return HttpResponseRedirect(reverse("approvals"))
    # Without JavaScript: the inbox page with this card alone, its error and the text as typed.
    context.update(nav="approvals", rows=[row], is_operator=True, form=DecisionForm())
    return render(request, "approvals/inbox.html", context, status=status)


def _edit_error(error: DomainError) -> str:
    """The message, with the fields a validation error names (a JSON pointer)."""
    parts = [error.message]
    for item in error.extra.get("errors") or []:
        message = str(item.get("message") or "") if isinstance(item, dict) else ""
        if message and message not in error.message:
            parts.append(f"{item.get('field')}: {message}")
    return "; ".join(parts)
