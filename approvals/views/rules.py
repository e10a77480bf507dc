"""Auto-approve rules: admins edit; operators, admins and auditors read."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET, require_POST

from approvals.forms import AutoApproveRuleForm
from approvals.models import AutoApproveRule
from approvals.services import grants as grant_services
from approvals.services import rules as rule_services
from audit.services import Actor
from console import permissions
from console.pages import (
    EditablePage,
    console_page,
    error_status,
    forbid_unless,
    forbid_unless_reader,
    render_fragment_or_page,
)
from engine.core.errors import DomainError

RULES = EditablePage(template="approvals/rules.html", url_name="rules", event="rules-changed")


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
        # Standing grants made from approvals ("approve and allow similar"), live first.
        "grants": [
            grant_services.grant_as_dict(grant)
            for grant in grant_services.grants_visible_to(request.user).order_by(
                "revoked_at", "-created_at"
            )[:100]
        ],
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


_READERS_ONLY = "Auto-approve rules are shown to operators, admins and auditors."


@console_page
@require_GET
def rules_page(request: HttpRequest) -> HttpResponse:
    forbid_unless_reader(request, _READERS_ONLY)
    form = None
    editing = None
    edit = request.GET.get("edit", "")
    if edit.isdigit() and permissions.is_admin(request.user):
        editing = AutoApproveRule.objects.select_related("agent").filter(pk=int(edit)).first()
        if editing is not None:
            form = AutoApproveRuleForm(initial=_rule_form_initial(editing))
    context = _rules_context(request, form=form, editing=editing)
    return render_fragment_or_page(request, RULES.template, context, partial="page")


def _rule_save(request: HttpRequest, rule_id: int | None) -> HttpResponse:
    forbid_unless_reader(request, _READERS_ONLY)
    forbid_unless(permissions.is_admin(request.user), "Only admins edit auto-approve rules.")
    editing = None
    if rule_id is not None:
        editing = get_object_or_404(AutoApproveRule, pk=rule_id)
    form = AutoApproveRuleForm(request.POST)

    def save() -> str:
        if rule_id is None:
            rule = rule_services.auto_approve_rule_create(
                actor=Actor.person(request.user), **_rule_values(form)
            )
            return f"Rule {rule.pk} created."
        rule, changed = rule_services.auto_approve_rule_update(
            actor=Actor.person(request.user), rule_id=rule_id, **_rule_values(form)
        )
        return f"Rule {rule.pk} saved." if changed else f"Rule {rule.pk} is unchanged."

    return RULES.submit(request, form, save, _rules_context, form=form, editing=editing)


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
    forbid_unless_reader(request, _READERS_ONLY)
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
                actor=Actor.person(request.user), rule_id=rule.pk, **values
            )
        except DomainError as exc:
            status = error_status(exc)
        else:
            verb = "enabled" if values["enabled"] else "disabled"
            notice = f"Rule {rule.pk} {verb}." if changed else f"Rule {rule.pk} was already {verb}."
    return RULES.respond(request, lambda: _rules_context(request), notice=notice, status=status)


@console_page
@require_POST
def rule_delete_view(request: HttpRequest, rule_id: int) -> HttpResponse:
    forbid_unless_reader(request, _READERS_ONLY)
    forbid_unless(permissions.is_admin(request.user), "Only admins edit auto-approve rules.")
    deleted = rule_services.auto_approve_rule_delete(
        actor=Actor.person(request.user), rule_id=rule_id
    )
    notice = f"Rule {rule_id} deleted." if deleted else f"Rule {rule_id} was already gone."
    return RULES.respond(request, lambda: _rules_context(request), notice=notice)


@console_page
@require_POST
def grant_revoke_view(request: HttpRequest, grant_id: int) -> HttpResponse:
    """Revoke a standing grant (its owner or an admin; audited by the service)."""
    forbid_unless_reader(request, _READERS_ONLY)
    try:
        grant_services.grant_revoke(grant_id=grant_id, person=request.user)
    except DomainError as exc:
        return RULES.respond(
            request, lambda: _rules_context(request), notice=exc.message, status=error_status(exc)
        )
    notice = f"Grant {grant_id} revoked: it admits nothing from now on."
    return RULES.respond(request, lambda: _rules_context(request), notice=notice)
