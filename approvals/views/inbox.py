"""The approvals inbox: pending approvals with their diff, live arrivals, one decision at a time."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.db.models import Exists, OuterRef, Prefetch, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_GET, require_POST

from approvals.forms import DecisionForm
from approvals.models import (
    Agent,
    Approval,
    ApprovalDecision,
    ApprovalStatus,
    ClaimSubject,
    Grant,
    PlanStep,
)
from approvals.selectors import approval_get_for_person, approval_list_for_person
from approvals.services.claims import active_claims, claim_end_on_decision, claim_fingerprint
from approvals.services.decisions import (
    APPROVE_WITH_EDITS,
    approval_decide,
    approval_decide_tallied,
)
from approvals.services.grants import grants_may_admit
from approvals.services.separation import approvals_forbidding_self
from approvals.views.plan_rows import plan_step_rows
from audit.services import Actor
from console import permissions
from console.pages import EVENT_COUNTS, console_page, error_status, is_htmx, render_fragment_or_page
from engine.core import jsonsafe
from engine.core.errors import DomainError, NotFound
from ownership.diff import document_diff_view, proposed_document
from ownership.models import ConflictClass

EVENT_APPROVALS = "approvals-changed"
INBOX_PAGE = 25


def _approval_rows(approvals: list[Approval], user: Any) -> list[dict[str, Any]]:
    # Separation of duties: no decision is offered where the person would be refused.
    kept_out = approvals_forbidding_self(approvals=approvals, actor=Actor.person(user))
    claims = active_claims(ClaimSubject.APPROVAL, (a.pk for a in approvals))
    confirm_classes = set(settings.AIRLOCK_INBOX_CONFIRM_CLASSES)
    rows = []
    for approval in approvals:
        decisions = list(approval.decisions.all())
        claim = claims.get(approval.pk)
        row: dict[str, Any] = {
            "approval": approval,
            "decisions": decisions,
            "approvals_so_far": sum(1 for d in decisions if d.decision == "approve"),
            "self_approval": approval.pk in kept_out,
            "claim": claim,
            "claim_fp": claim_fingerprint(claim),
        }
        if approval.plan_id is not None:
            # One card for the whole plan: every step against the document now.
            steps = PlanStep.objects.filter(plan_id=approval.plan_id).order_by("position")
            row["plan_steps"] = plan_step_rows(list(steps.select_related("applied_operation")))
            row["destructive"] = any(
                srow.step.operation == "delete" or srow.step.conflict_class_id in confirm_classes
                for srow in row["plan_steps"]
            )
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
            # "Approve and allow similar" only where a grant could ever admit such a write
            # (its class allows grants, per-call, a quorum of one): never a form that can
            # only be refused.
            row["grantable"] = approval.plan_id is None and grants_may_admit(action.conflict_class)
            row["edit_text"] = json.dumps(action.payload, indent=2, ensure_ascii=False)
            row["destructive"] = (
                action.operation == "delete" or action.conflict_class_id in confirm_classes
            )
        rows.append(row)
    return rows


def _needs_confirmation(approval: Approval) -> bool:
    """A delete, or a class listed in AIRLOCK_INBOX_CONFIRM_CLASSES (any step of a plan)."""
    classes = settings.AIRLOCK_INBOX_CONFIRM_CLASSES
    if approval.plan_id is not None:
        steps = PlanStep.objects.filter(plan_id=approval.plan_id)
        return steps.filter(Q(operation="delete") | Q(conflict_class_id__in=classes)).exists()
    action = approval.action
    return action is not None and (
        action.operation == "delete" or action.conflict_class_id in classes
    )


def _approvals_for(user: Any, *, status: str | None = ApprovalStatus.PENDING) -> Any:
    """The engine's selector: approvals this person may decide, oldest first."""
    return (
        approval_list_for_person(user, status=status)
        .select_related("action__agent", "action__conflict_class", "plan")
        .prefetch_related(
            Prefetch("decisions", queryset=ApprovalDecision.objects.select_related("person"))
        )
    )


# The inbox's age filter: waiting longer than this.
INBOX_AGES = {
    "5m": ("waiting over 5 minutes", timedelta(minutes=5)),
    "1h": ("waiting over an hour", timedelta(hours=1)),
    "1d": ("waiting over a day", timedelta(days=1)),
}
FILTER_NAMES = ("agent", "resource", "class", "age", "mine")


def _filters(query: Any) -> dict[str, str]:
    """The inbox's GET filters, bounded (an unknown age or a `mine` other than 1 is none)."""
    chosen = {name: str(query.get(name, "") or "").strip()[:200] for name in FILTER_NAMES}
    if chosen["age"] not in INBOX_AGES:
        chosen["age"] = ""
    if chosen["mine"] != "1":
        chosen["mine"] = ""
    return chosen


def _filter_approvals(qs: QuerySet[Approval], chosen: dict[str, str], user: Any) -> Any:
    """Agent (exact name), resource (a `kind/name` prefix: call approvals by their write,
    plan approvals by any step; a run approval names no single resource and is left out),
    class (the call's class or any plan step's), age, and "waiting for me": not yet
    decided by this person (separation of duties is applied to the page's rows)."""
    if chosen["agent"]:
        qs = qs.filter(run__agent__name=chosen["agent"])
    if chosen["resource"]:
        kind, slash, name = chosen["resource"].partition("/")
        if slash:
            on_action = Q(action__kind_id=kind, action__name__startswith=name)
            steps = PlanStep.objects.filter(kind_id=kind, name__startswith=name)
        else:
            on_action = Q(action__kind__slug__startswith=kind)
            steps = PlanStep.objects.filter(kind__slug__startswith=kind)
        qs = qs.filter(on_action | Exists(steps.filter(plan_id=OuterRef("plan_id"))))
    if chosen["class"]:
        steps = PlanStep.objects.filter(
            plan_id=OuterRef("plan_id"), conflict_class_id=chosen["class"]
        )
        qs = qs.filter(Q(action__conflict_class_id=chosen["class"]) | Exists(steps))
    if chosen["age"]:
        qs = qs.filter(created_at__lte=timezone.now() - INBOX_AGES[chosen["age"]][1])
    if chosen["mine"]:
        mine = ApprovalDecision.objects.filter(approval_id=OuterRef("pk"), person_id=user.pk)
        qs = qs.filter(~Exists(mine))
    return qs


def _waiting_rows(approvals: list[Approval], user: Any, chosen: dict[str, str]) -> list[Any]:
    rows = _approval_rows(approvals, user)
    if chosen["mine"]:
        # "Waiting for me": what this person may decide, so not those kept from them.
        rows = [row for row in rows if not row["self_approval"]]
    return rows


def _filter_query(chosen: dict[str, str]) -> str:
    return urlencode({k: v for k, v in chosen.items() if v})


@console_page
@require_GET
def approvals_inbox(request: HttpRequest) -> HttpResponse:
    user = request.user
    chosen = _filters(request.GET)
    # Oldest first: the one waiting longest is decided first.
    qs = _filter_approvals(_approvals_for(user), chosen, user).order_by("created_at", "id")
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
    filter_query = _filter_query(chosen)
    context = {
        "nav": "approvals",
        "rows": _waiting_rows(approvals, user, chosen),
        "may_decide": True,
        "is_operator": permissions.can_decide_approvals(user),
        "next_cursor": next_cursor,
        "form": DecisionForm(),
        "chosen": chosen,
        "filter_query": filter_query,
        "filtered": any(chosen.values()),
        "ages": [(key, label) for key, (label, _) in INBOX_AGES.items()],
        # Selects, not free text: the agents and classes there are (small catalogues).
        "agents": list(Agent.objects.order_by("name").values_list("name", flat=True)[:500]),
        "classes": list(ConflictClass.objects.order_by("slug").values_list("slug", flat=True)),
        "back": request.get_full_path(),
        # Every page polls for its cards' claims and departures; the last page also for
        # approvals that arrive while it is open.
        "poll_query": _poll_query(approvals, since=timezone.now(), filter_query=filter_query)
        + ("&arrivals=0" if next_cursor else ""),
    }
    response = render_fragment_or_page(request, "approvals/inbox.html", context, partial="list")
    if is_htmx(request) and request.headers.get("HX-Trigger") == "approval-filters":
        # The filter form sends its empty fields too: the address pushed into the history
        # (what a bookmark keeps) names only the filters chosen.
        url = reverse("approvals")
        response["HX-Push-Url"] = f"{url}?{filter_query}" if filter_query else url
    return response


# A row can commit a little after a later-created one (created_at is set at
# insert time): the poll looks back this far and skips the ids the page shows.
POLL_LOOKBACK = timedelta(seconds=120)
POLL_BATCH = 20
# At most this many cards' states are checked by one poll (a page shows 25 and what arrived).
POLL_SHOWN = 200


def _poll_query(shown: list[Approval], *, since: datetime, filter_query: str = "") -> str:
    """The poller's query string: the newest time seen and the ids shown within
    the look-back window before it (so nothing is missed and nothing shown twice),
    and the page's filters (the refresh shows only what they let through)."""
    newest = max([since, *(a.created_at for a in shown)])
    recent = sorted(str(a.id) for a in shown if a.created_at > newest - POLL_LOOKBACK)
    query = urlencode({"since": newest.isoformat(), "seen": ",".join(recent)})
    return f"{query}&{filter_query}" if filter_query else query


def _shown_states(value: str) -> dict[uuid.UUID, str]:
    """`shown`: the cards still pending on the page, as `id~claim fingerprint` pairs
    (sent by static/inbox-keys.js); malformed entries are ignored."""
    states: dict[uuid.UUID, str] = {}
    for entry in value.split(",")[:POLL_SHOWN]:
        raw_id, _, fingerprint = entry.partition("~")
        approval_id = _uuid_or_none(raw_id)
        if approval_id is not None:
            states[approval_id] = fingerprint[:64]
    return states


@console_page
@require_GET
def approvals_poll(request: HttpRequest) -> HttpResponse:
    """The open inbox's live refresh, swapped out of band without touching the cards
    that did not change (a comment being typed, the focus, survive):
    - new pending approvals matching the page's filters are appended;
    - a shown card that is no longer pending (decided elsewhere, expired) is replaced
      by its decided form;
    - a shown card whose claim changed gets its new claim line.

    204 (htmx: no swap) when nothing changed; otherwise the swaps plus a fresh poller
    carrying the advanced cursor, and HX-Trigger for the counters.
    """
    since = parse_datetime(request.GET.get("since") or "")
    if since is None or timezone.is_naive(since):
        return HttpResponse("Bad poll cursor", status=400, content_type="text/plain")
    user = request.user
    chosen = _filters(request.GET)
    seen = [u for u in (_uuid_or_none(v) for v in request.GET.get("seen", "").split(",")) if u]
    arrivals = request.GET.get("arrivals") != "0"
    fresh = (
        list(
            _filter_approvals(_approvals_for(user), chosen, user)
            .filter(created_at__gt=since - POLL_LOOKBACK)
            .exclude(pk__in=seen[:500])
            .order_by("created_at", "id")[:POLL_BATCH]
        )
        if arrivals
        else []
    )
    shown = _shown_states(request.GET.get("shown", ""))
    left: list[Approval] = []
    claims_changed: list[dict[str, Any]] = []
    if shown:
        statuses = dict(Approval.objects.filter(pk__in=list(shown)).values_list("id", "status"))
        gone = [pk for pk in shown if statuses.get(pk, ApprovalStatus.PENDING) != "pending"]
        if gone:
            left = list(_approvals_for(user, status=None).filter(pk__in=gone))
        claims = active_claims(ClaimSubject.APPROVAL, (pk for pk in shown if pk not in gone))
        claims_changed = [
            {"id": pk, "claim": claims.get(pk), "claim_fp": claim_fingerprint(claims.get(pk))}
            for pk, fingerprint in shown.items()
            if pk not in gone and claim_fingerprint(claims.get(pk)) != fingerprint
        ]
    if not fresh and not left and not claims_changed:
        return HttpResponse(status=204)
    # Keep the ids still inside the window: those already shown and these new ones.
    still_recent = list(
        Approval.objects.filter(pk__in=seen[:500], created_at__gt=since - POLL_LOOKBACK)
    )
    context = {
        "rows": _waiting_rows(fresh, user, chosen),
        "left_rows": _approval_rows(left, user),
        "claims_changed": claims_changed,
        "may_decide": True,
        "back": reverse("approvals")
        + ("?" + _filter_query(chosen) if any(chosen.values()) else ""),
        "poll_query": _poll_query(
            [*still_recent, *fresh], since=since, filter_query=_filter_query(chosen)
        )
        + ("" if arrivals else "&arrivals=0"),
    }
    response = render(request, "approvals/inbox.html#poll_news", context)
    if fresh or left:
        response["HX-Trigger"] = json.dumps({EVENT_COUNTS: True})
    return response


def _held_by_another(approval_id: uuid.UUID, user: Any) -> str:
    """Why `user` may not decide now: someone else's live claim (take it over first, so
    two people never silently work the same approval). Empty when free or theirs."""
    claim = active_claims(ClaimSubject.APPROVAL, [approval_id]).get(approval_id)
    if claim is None or claim.holder_id == user.pk:
        return ""
    name = claim.holder.get_username()
    return f"{name} is on it: take it over from {name} before deciding."


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
    granting = request.POST.get("grant") == "1"
    # "Approve and allow similar" submits with its own button (no `decision` member).
    form = DecisionForm(
        {**request.POST.dict(), "decision": "approve"} if granting else request.POST
    )
    error: str | None = None
    status = 200
    if form.is_valid():
        decision = form.cleaned_data["decision"]
        held = _held_by_another(approval.id, user)
        if held:
            error, status = held, 409
        elif (
            decision == "approve"
            and request.POST.get("confirm") != "1"
            and _needs_confirmation(approval)
        ):
            # A delete or a class marked for it: a deliberate confirmation, not one click.
            error = (
                "Tick “I confirm” to approve this write: it deletes or is of a class "
                "that asks for a confirmation."
            )
            status = 422
        else:
            try:
                approval_decide(
                    approval_id=approval.id,
                    actor=Actor.person(user),
                    decision=decision,
                    comment=form.cleaned_data["comment"],
                    grant=_grant_from_form(request.POST) if granting else None,
                )
                # The item is decided: whoever was on it is no longer (audited).
                claim_end_on_decision(
                    subject=ClaimSubject.APPROVAL, subject_id=approval.id, person=user
                )
            except DomainError as exc:
                error = exc.message
                status = error_status(exc)
    else:
        error = "; ".join(str(e) for errors in form.errors.values() for e in errors)
        status = 422

    def fragment() -> HttpResponse:
        fresh = _approvals_for(user, status=None).get(pk=approval.pk)
        row = _approval_rows([fresh], user)[0]
        if granting and error is None:
            # The decided card says what the person just granted (and where to revoke it).
            row["grant"] = Grant.objects.filter(approval_id=approval.pk).first()
        context = {"row": row, "may_decide": True, "error": error}
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
    """Approve with edits from a call approval's card (or one step of a plan's: `step`):
    the edited document (JSON, through the one parser) and a comment. Errors are shown in
    the card, a call's text kept as typed."""
    user = request.user
    try:
        approval = approval_get_for_person(user, approval_id)
    except NotFound as exc:
        raise Http404(exc.message) from exc
    text = request.POST.get("document", "")
    step = request.POST.get("step")
    error: str | None = None
    status = 200
    try:
        held = _held_by_another(approval.id, user)
        if held:
            raise DomainError(held, code="claim_held")
        document = jsonsafe.loads(text, field="document")
        edit: dict[str, Any] = {"document": document}
        if step is not None:
            # A plan card's step form; a position that is not a whole number is refused
            # by the service (422), as through the API.
            edit["step"] = int(step) if step.isdigit() else step
        approval_decide_tallied(
            approval_id=approval.id,
            actor=Actor.person(user),
            person=user,
            decision=APPROVE_WITH_EDITS,
            comment=request.POST.get("comment", ""),
            edit=edit,
        )
        claim_end_on_decision(subject=ClaimSubject.APPROVAL, subject_id=approval.id, person=user)
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
        replaced = "plan" if step is not None else "write"
        messages.success(
            request, f"Approved with your edits: the edited {replaced} replaces the agent's."
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


def _grant_from_form(data: Any) -> dict[str, Any]:
    """The card's grant fields as the decision service takes them (it checks and caps them;
    a value that is not a whole number is passed on as text and refused there, 422)."""

    def whole(name: str) -> Any:
        raw = str(data.get(name) or "").strip()
        return int(raw) if raw.isdigit() else raw

    minutes = whole("grant_minutes")
    return {
        "uses": whole("grant_uses"),
        "ttl_seconds": minutes * 60 if isinstance(minutes, int) else minutes,
        "name_prefix": str(data.get("grant_prefix") or ""),
    }
