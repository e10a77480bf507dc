"""Approvals inbox, actions, runs and tokens pages."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError
from django.db.models import Exists, OuterRef, Prefetch, Q
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_GET, require_POST

from approvals.forms import (
    AgentCreateForm,
    AgentTokenCreateForm,
    AutoApproveRuleForm,
    DecisionForm,
    PersonalTokenCreateForm,
    RevokeForm,
    RunFilterForm,
)
from approvals.models import (
    Action,
    Agent,
    AgentToken,
    Approval,
    ApprovalDecision,
    ApprovalStatus,
    AutoApproveRule,
    PersonalToken,
    Run,
    RunStatus,
)
from approvals.selectors import (
    action_list_for_actor,
    approval_get_for_person,
    approval_list_for_person,
    run_list_for_actor,
)
from approvals.services import rules as rule_services
from approvals.services import tokens as token_services
from approvals.services.decisions import approval_decide
from approvals.services.runs import run_revoke
from approvals.services.tokens import token_revoke
from audit.services import Actor
from console import permissions
from console.core.errors import DomainError, NotFound
from console.views import (
    EVENT_COUNTS,
    console_page,
    document_diff,
    domain_error_status,
    forbid_unless,
    form_errors_from,
    is_htmx,
    keyset_page,
    pretty,
    proposed_document,
    query_without,
    render_fragment_or_page,
    respond_page,
    signed_in,
)
from ownership.models import OwnershipRecord

EVENT_APPROVALS = "approvals-changed"
INBOX_PAGE = 25


# --- who may see what: the engine's selectors -------------------------------------------


def runs_visible_to(user: Any) -> Any:

    return run_list_for_actor(user)


def actions_visible_to(user: Any) -> Any:

    return action_list_for_actor(user)


# --- approvals inbox ----------------------------------------------------------------


def _approval_rows(approvals: list[Approval]) -> list[dict[str, Any]]:
    rows = []
    for approval in approvals:
        decisions = list(approval.decisions.all())
        row: dict[str, Any] = {
            "approval": approval,
            "decisions": decisions,
            "approvals_so_far": sum(1 for d in decisions if d.decision == "approve"),
        }
        action = approval.action
        if action is not None:
            current = action.resource
            row["current_version"] = current.version if current else None
            row["version_moved"] = (
                current is not None
                and action.observed_version is not None
                and current.version != action.observed_version
            )
            before = current.document if current and not current.deleted else None
            row["diff"] = document_diff(before, proposed_document(action))
        rows.append(row)
    return rows


def _approvals_for(user: Any, *, status: str | None = ApprovalStatus.PENDING) -> Any:
    """The engine's selector: approvals this person may decide, oldest first."""

    return (
        approval_list_for_person(user, status=status)
        .select_related("action__agent")
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
        "rows": _approval_rows(approvals),
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
        "rows": _approval_rows(fresh),
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
                person=user,
                decision=form.cleaned_data["decision"],
                comment=form.cleaned_data["comment"],
            )
        except DomainError as exc:
            error = exc.message
            status = domain_error_status(exc)
    else:
        error = "; ".join(str(e) for errors in form.errors.values() for e in errors)
        status = 422

    def fragment() -> HttpResponse:
        fresh = _approvals_for(user, status=None).get(pk=approval.pk)
        context = {"row": _approval_rows([fresh])[0], "may_decide": True, "error": error}
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


# --- actions ---------------------------------------------------------------------------


def _action_for(user: Any, action_id: uuid.UUID) -> Action:
    action = (
        actions_visible_to(user)
        .select_related("run", "agent", "resource", "conflict_class")
        .filter(pk=action_id)
        .first()
    )
    if action is None:
        raise Http404("No such action")
    found: Action = action
    return found


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
    runs = runs_visible_to(request.user).select_related("agent")
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
    rows, next_cursor = keyset_page(runs, cursor=request.GET.get("cursor"))
    context = {
        "nav": "runs",
        "form": form if form.is_bound else RunFilterForm(),
        "runs": rows,
        "next_cursor": next_cursor,
        "query": query_without(request, "cursor"),
        "now": timezone.now(),
    }
    return render_fragment_or_page(request, "approvals/runs.html", context, partial="list")


def _run_for(user: Any, run_id: uuid.UUID) -> Run:
    run = runs_visible_to(user).select_related("agent").filter(pk=run_id).first()
    if run is None:
        raise Http404("No such run")
    found: Run = run
    return found


def _run_context(request: HttpRequest, run: Run) -> dict[str, Any]:
    actions = list(
        run.actions.select_related("conflict_class", "resource").order_by("-created_at")[:100]
    )
    records = list(OwnershipRecord.objects.filter(run=run).order_by("-active", "kind_id", "name"))
    now = timezone.now()
    heartbeat_age = (
        int((now - run.last_heartbeat_at).total_seconds()) if run.last_heartbeat_at else None
    )
    return {
        "nav": "runs",
        "run": run,
        "actions": actions,
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
    if is_htmx(request) and ended and all(a.is_final for a in context["actions"]):
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
        return respond(error=exc.message, status=domain_error_status(exc))
    run.refresh_from_db()
    return respond(notice="Run revoked: its ownership records are released.")


# --- tokens -----------------------------------------------------------------------------------


def _tokens_context(request: HttpRequest, **extra: Any) -> dict[str, Any]:
    user = request.user
    admin = permissions.is_admin(user)
    context: dict[str, Any] = {
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
    }
    context.update(extra)
    return context


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

    changed = token_revoke(token=token, actor=Actor.person(request.user))
    verb = "revoked" if changed else "was already revoked"
    return _after_revoke(request, f"Token {token.prefix}… {verb}.")


@console_page
@require_POST
def agent_create(request: HttpRequest) -> HttpResponse:
    forbid_unless(permissions.is_admin(request.user), "Only admins create agents.")
    form = AgentCreateForm(request.POST)
    if not form.is_valid():
        return _tokens_render(request, status=422, agent_form=form)
    try:
        agent, secret = token_services.agent_create(
            name=form.cleaned_data["name"],
            description=form.cleaned_data["description"],
            owner=form.cleaned_data["owner"],
            actor=Actor.person(request.user),
        )
    except IntegrityError:
        # Two admins racing for the same name: the unique constraint decides.
        form.add_error("name", "An agent with this name already exists.")
        return _tokens_render(request, status=422, agent_form=form)
    except DomainError as exc:
        form.add_error("name", exc.message)
        return _tokens_render(request, status=domain_error_status(exc), agent_form=form)
    return _show_secret(request, what=f"agent token for {agent.name}", secret=secret)


@console_page
@require_POST
def agent_token_create(request: HttpRequest, agent_id: uuid.UUID) -> HttpResponse:
    forbid_unless(permissions.is_admin(request.user), "Only admins create agent tokens.")
    agent = get_object_or_404(Agent, pk=agent_id)
    form = AgentTokenCreateForm(request.POST)
    if not form.is_valid():
        return _tokens_render(
            request, status=422, agent_token_form=form, agent_token_error_for=agent.pk
        )
    _token, secret = token_services.agent_token_create(
        agent=agent, label=form.cleaned_data["label"], actor=Actor.person(request.user)
    )
    return _show_secret(request, what=f"agent token for {agent.name}", secret=secret)


@console_page
@require_POST
def agent_token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    if not permissions.is_admin(request.user):
        raise PermissionDenied("Only admins revoke agent tokens.")
    token = get_object_or_404(AgentToken, pk=token_id)

    changed = token_revoke(token=token, actor=Actor.person(request.user))
    verb = "revoked" if changed else "was already revoked"
    return _after_revoke(request, f"Agent token {token.prefix}… {verb}.")


# --- auto-approve rules (admins edit; everyone who reads everything sees them) ------------

EVENT_RULES = "rules-changed"
RULES_TEMPLATE = "approvals/rules.html"


def _rule_form_initial(rule: AutoApproveRule) -> dict[str, Any]:
    return {
        "kind": rule.kind_id,
        "name_prefix": rule.name_prefix,
        "operations": list(rule.operations or []),
        "agent": rule.agent.name if rule.agent else "",
        "description": rule.description,
        "enabled": rule.enabled,
    }


def _rules_context(
    request: HttpRequest, *, form: AutoApproveRuleForm | None = None, editing: Any = None
) -> dict[str, Any]:
    return {
        "nav": "rules",
        "rules": list(
            AutoApproveRule.objects.select_related("agent").order_by("kind_id", "name_prefix", "id")
        ),
        "is_admin": permissions.is_admin(request.user),
        "rule_form": form or AutoApproveRuleForm(),
        "editing": editing,
    }


def _rule_values(form: AutoApproveRuleForm) -> dict[str, Any]:
    data = form.cleaned_data
    return {
        "kind": data["kind"],
        "name_prefix": data["name_prefix"],
        "operations": list(data["operations"]),
        "agent": data["agent"] or None,
        "description": data["description"],
        "enabled": bool(data["enabled"]),
    }


def _rules_visible(request: HttpRequest) -> None:
    forbid_unless(
        permissions.can_read_everything(request.user),
        "Auto-approve rules are shown to operators, admins and auditors.",
    )


@console_page
@require_GET
def rules_page(request: HttpRequest) -> HttpResponse:
    _rules_visible(request)
    form = None
    editing = None
    edit = request.GET.get("edit", "")
    if edit.isdigit() and permissions.is_admin(request.user):
        editing = AutoApproveRule.objects.select_related("agent").filter(pk=int(edit)).first()
        if editing is not None:
            form = AutoApproveRuleForm(initial=_rule_form_initial(editing))
    context = _rules_context(request, form=form, editing=editing)
    return render_fragment_or_page(request, RULES_TEMPLATE, context, partial="page")


def _rule_save(request: HttpRequest, rule_id: int | None) -> HttpResponse:
    _rules_visible(request)
    forbid_unless(permissions.is_admin(request.user), "Only admins edit auto-approve rules.")
    editing = None
    if rule_id is not None:
        editing = get_object_or_404(AutoApproveRule, pk=rule_id)
    form = AutoApproveRuleForm(request.POST)

    def respond(*, notice: str = "", status: int = 200) -> HttpResponse:
        failed = status >= 400
        return respond_page(
            request,
            template=RULES_TEMPLATE,
            context=lambda: _rules_context(
                request, form=form if failed else None, editing=editing if failed else None
            ),
            redirect_to=reverse("rules"),
            notice=notice,
            status=status,
            events=(EVENT_RULES,),
        )

    if not form.is_valid():
        return respond(status=422)
    try:
        if rule_id is None:
            rule = rule_services.auto_approve_rule_create(user=request.user, **_rule_values(form))
            notice = f"Rule {rule.pk} created."
        else:
            rule, changed = rule_services.auto_approve_rule_update(
                user=request.user, rule_id=rule_id, **_rule_values(form)
            )
            notice = f"Rule {rule.pk} saved." if changed else f"Rule {rule.pk} is unchanged."
    except DomainError as exc:
        form_errors_from(form, exc)
        return respond(status=domain_error_status(exc))
    return respond(notice=notice)


@console_page
@require_POST
def rule_create_view(request: HttpRequest) -> HttpResponse:
    return _rule_save(request, None)


@console_page
@require_POST
def rule_update_view(request: HttpRequest, rule_id: int) -> HttpResponse:
    return _rule_save(request, rule_id)


@console_page
@require_POST
def rule_enable_view(request: HttpRequest, rule_id: int) -> HttpResponse:
    """Disable or re-enable a rule, keeping its other fields (the form is a single button)."""
    _rules_visible(request)
    forbid_unless(permissions.is_admin(request.user), "Only admins edit auto-approve rules.")
    rule = get_object_or_404(AutoApproveRule.objects.select_related("agent"), pk=rule_id)
    enabled = request.POST.get("enabled")
    status = 200
    notice = ""
    if enabled not in ("0", "1"):
        status = 422
    else:
        values = _rule_form_initial(rule)
        values["agent"] = values["agent"] or None
        values["enabled"] = enabled == "1"
        try:
            _rule, changed = rule_services.auto_approve_rule_update(
                user=request.user, rule_id=rule.pk, **values
            )
        except DomainError as exc:
            status = domain_error_status(exc)
        else:
            verb = "enabled" if values["enabled"] else "disabled"
            notice = f"Rule {rule.pk} {verb}." if changed else f"Rule {rule.pk} was already {verb}."
    return respond_page(
        request,
        template=RULES_TEMPLATE,
        context=lambda: _rules_context(request),
        redirect_to=reverse("rules"),
        notice=notice,
        status=status,
        events=(EVENT_RULES,),
    )


@console_page
@require_POST
def rule_delete_view(request: HttpRequest, rule_id: int) -> HttpResponse:
    _rules_visible(request)
    forbid_unless(permissions.is_admin(request.user), "Only admins edit auto-approve rules.")
    deleted = rule_services.auto_approve_rule_delete(user=request.user, rule_id=rule_id)
    return respond_page(
        request,
        template=RULES_TEMPLATE,
        context=lambda: _rules_context(request),
        redirect_to=reverse("rules"),
        notice=f"Rule {rule_id} deleted." if deleted else f"Rule {rule_id} was already gone.",
        events=(EVENT_RULES,),
    )
