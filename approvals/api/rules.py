"""API: auto-approve rules (admins write; operators, admins and auditors read)."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from ninja import Path, Query, Router

from approvals.api.schemas import AutoApproveRuleIn, AutoApproveRuleOut, AutoApproveRulePage
from approvals.api.serialize import rule_load
from approvals.models import AutoApproveRule
from approvals.services import rules as rule_services
from approvals.services.rules import rule_as_dict
from console.api_support import (
    Keyset,
    RoleBearer,
    json_response,
    page_response,
    writing_principal,
)
from console.permissions import can_read_everything, is_admin
from console.problems import errors
from engine.core.errors import NotFound

router = Router(tags=["auto-approve rules"])

_MAX_RULE_ID = 2**63 - 1
_RULE_ID = Path(..., ge=1, le=_MAX_RULE_ID)
# By id; the cursor is the last id (any pattern-valid value is a position).
_BY_ID = Keyset(
    ("id",), False, lambda values: str(values[0]), lambda raw: [min(int(raw), _MAX_RULE_ID)]
)

# Decided while authenticating, before query or body validation (no schema leak).
rules_reader_token = RoleBearer(
    can_read_everything, "Auto-approve rules are shown to operators, admins and auditors."
)
rules_admin_token = RoleBearer(is_admin, "Only admins edit auto-approve rules.")


@router.get(
    "/auto-approve-rules",
    auth=rules_reader_token,
    response={200: AutoApproveRulePage, **errors(400, 401, 403, 422)},
    summary="Auto-approve rules (operators, admins, auditors), by id",
)
def auto_approve_rule_list(
    request: HttpRequest,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=r"^[0-9]{1,19}$", description="`next` of a page"),
) -> HttpResponse:
    rules = AutoApproveRule.objects.select_related("agent")
    return page_response(rules, keyset=_BY_ID, cursor=cursor, limit=limit, render=rule_as_dict)


@router.get(
    "/auto-approve-rules/{rule_id}",
    auth=rules_reader_token,
    response={200: AutoApproveRuleOut, **errors(401, 403, 404, 422)},
    summary="One auto-approve rule",
)
def auto_approve_rule_get(request: HttpRequest, rule_id: int = _RULE_ID) -> HttpResponse:
    return json_response(rule_as_dict(rule_load(rule_id)))


@router.post(
    "/auto-approve-rules",
    auth=rules_admin_token,
    response={201: AutoApproveRuleOut, **errors(400, 401, 403, 413, 422, 429)},
    summary="Create an auto-approve rule (admins; audited)",
    description="A run whose every write-set entry is covered by an enabled rule (kind, name "
    "prefix, operations, and the agent when set) is activated without a person. Unknown kinds "
    "or agents are 422.",
)
def auto_approve_rule_post(request: HttpRequest, payload: AutoApproveRuleIn) -> HttpResponse:
    principal = writing_principal(request)
    rule = rule_services.auto_approve_rule_create(actor=principal.actor, **payload.model_dump())
    return json_response(
        rule_as_dict(rule_load(rule.pk)),
        status=201,
        headers={"Location": f"/api/v1/auto-approve-rules/{rule.pk}"},
    )


@router.put(
    "/auto-approve-rules/{rule_id}",
    auth=rules_admin_token,
    response={200: AutoApproveRuleOut, **errors(400, 401, 403, 404, 413, 422, 429)},
    summary="Replace an auto-approve rule (admins; audited when something changed)",
)
def auto_approve_rule_put(
    request: HttpRequest, payload: AutoApproveRuleIn, rule_id: int = _RULE_ID
) -> HttpResponse:
    principal = writing_principal(request)
    rule_services.auto_approve_rule_update(
        actor=principal.actor, rule_id=rule_id, **payload.model_dump()
    )
    return json_response(rule_as_dict(rule_load(rule_id)))


@router.delete(
    "/auto-approve-rules/{rule_id}",
    auth=rules_admin_token,
    response={204: None, **errors(401, 403, 404, 422, 429)},
    summary="Delete an auto-approve rule (admins; audited)",
)
def auto_approve_rule_delete(request: HttpRequest, rule_id: int = _RULE_ID) -> HttpResponse:
    principal = writing_principal(request)
    if not rule_services.auto_approve_rule_delete(actor=principal.actor, rule_id=rule_id):
        raise NotFound(f"Auto-approve rule {rule_id} not found.")
    return HttpResponse(status=204)
