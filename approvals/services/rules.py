"""Auto-approve rules: admin-only edits, validated and audited.

A rule admits the run write-set entries it covers without a person (see
`approvals.services.write_sets.auto_approved`), so every change to one is an
admin decision that lands in the audit trail in the same transaction. A rule
stands in for one approver only: a run whose per-run classes need a quorum
above one waits for that many people whatever the rules say.
The console page calls these functions; an API can call the same ones.
"""

from __future__ import annotations

from typing import Any, Required, TypedDict, Unpack

from django.db import transaction

from approvals.models import Agent, AutoApproveRule
from approvals.services.write_sets import OPERATIONS
from audit.services import Actor, audit_append
from console.permissions import is_admin, require_person
from engine.core.errors import NotFound, ValidationFailed
from ownership.models import ResourceKind


def rule_as_dict(rule: AutoApproveRule) -> dict[str, Any]:
    return {
        "id": rule.pk,
        "kind": rule.kind_id,
        "name_prefix": rule.name_prefix,
        "operations": list(rule.operations or []),
        "agent": rule.agent.name if rule.agent_id and rule.agent else None,
        "enabled": rule.enabled,
        "description": rule.description,
    }


class RuleFields(TypedDict, total=False):
    """A rule's editable fields, as create and update take them (keyword arguments)."""

    kind: Required[str]
    operations: Required[list[str]]
    name_prefix: str  # "" covers every name of the kind
    agent: str | None  # None covers every agent
    description: str
    enabled: bool  # True unless given


def _clean(actor: Actor, fields: RuleFields) -> dict[str, Any]:
    """Who may edit rules (admins: Forbidden otherwise), then every field at once:
    ValidationFailed lists each bad one."""
    require_person(actor, is_admin, "Only admins edit auto-approve rules.")
    kind, operations = fields["kind"], fields["operations"]
    name_prefix, agent = fields.get("name_prefix", ""), fields.get("agent")
    description = fields.get("description", "")
    errors: list[dict[str, str]] = []
    kind_row = ResourceKind.objects.filter(slug=kind).first() if isinstance(kind, str) else None
    if kind_row is None:
        errors.append({"field": "kind", "message": "no such resource kind"})
    if not isinstance(name_prefix, str) or len(name_prefix) > 255 or "\x00" in name_prefix:
        errors.append({"field": "name_prefix", "message": "at most 255 characters"})
    if (
        not isinstance(operations, list)
        or not operations
        or any(op not in OPERATIONS for op in operations)
    ):
        errors.append({"field": "operations", "message": f"one or more of {', '.join(OPERATIONS)}"})
    agent_row = None
    if agent:
        agent_row = Agent.objects.filter(name=agent).first()
        if agent_row is None:
            errors.append({"field": "agent", "message": f"no agent is called {agent}"})
    if not isinstance(description, str) or len(description) > 200:
        errors.append({"field": "description", "message": "at most 200 characters"})
    if errors:
        raise ValidationFailed(
            "; ".join(f"{e['field']}: {e['message']}" for e in errors), extra={"errors": errors}
        )
    return {
        "kind": kind_row,
        "name_prefix": name_prefix,
        # Stored in the canonical order so an unchanged edit compares equal.
        "operations": [op for op in OPERATIONS if op in operations],
        "agent": agent_row,
        "description": description.strip(),
        "enabled": bool(fields.get("enabled", True)),
    }


def auto_approve_rule_create(*, actor: Actor, **fields: Unpack[RuleFields]) -> AutoApproveRule:
    """Create a rule (admins only). Raises Forbidden, ValidationFailed."""
    values = _clean(actor, fields)
    with transaction.atomic():
        rule = AutoApproveRule.objects.create(**values)
        audit_append(
            event_type="auto_approve_rule.created",
            actor=actor,
            details=rule_as_dict(rule),
        )
    return rule


def auto_approve_rule_update(
    *, actor: Actor, rule_id: int, **fields: Unpack[RuleFields]
) -> tuple[AutoApproveRule, bool]:
    """Replace a rule's fields (admins only); disabling is `enabled=False`.

    Locks the row (select_for_update) so two admins' edits serialise. Returns
    (rule, changed): an edit that changes nothing writes no audit row.
    Raises Forbidden, NotFound, ValidationFailed.
    """
    values = _clean(actor, fields)
    with transaction.atomic():
        rule = AutoApproveRule.objects.select_for_update().filter(pk=rule_id).first()
        if rule is None:
            raise NotFound("No such auto-approve rule.")
        before = rule_as_dict(rule)
        for field, value in values.items():
            setattr(rule, field, value)
        after = rule_as_dict(rule)
        if after == before:
            return rule, False
        rule.save()
        changed = {k: {"from": before[k], "to": after[k]} for k in after if before[k] != after[k]}
        audit_append(
            event_type="auto_approve_rule.updated",
            actor=actor,
            details={"id": rule.pk, "rule": after, "changed": changed},
        )
    return rule, True


def auto_approve_rule_delete(*, actor: Actor, rule_id: int) -> bool:
    """Delete a rule (admins only). Returns False when it was already gone
    (no second audit row). Raises Forbidden."""
    require_person(actor, is_admin, "Only admins edit auto-approve rules.")
    with transaction.atomic():
        rule = AutoApproveRule.objects.select_for_update().filter(pk=rule_id).first()
        if rule is None:
            return False
        details = rule_as_dict(rule)
        rule.delete()
        audit_append(event_type="auto_approve_rule.deleted", actor=actor, details=details)
    return True
