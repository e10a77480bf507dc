from __future__ import annotations

from django.contrib import admin

from approvals.models import (
    Action,
    Agent,
    AgentToken,
    Approval,
    ApprovalDecision,
    AutoApproveRule,
    Claim,
    Grant,
    IdempotencyRecord,
    Operation,
    PersonalToken,
    Plan,
    PlanStep,
    Run,
)
from console.admin import ReadOnlyAdmin, register_read_only


def _token_columns(owner: str) -> tuple[str, ...]:
    """An agent's or a person's tokens show the same columns, with their owner's."""
    return ("prefix", owner, "label", "created_at", "last_used_at", "revoked_at")


class TokenAdmin(ReadOnlyAdmin):
    """Tokens are created (and shown once) on the Tokens page; here only looked at."""

    exclude = ("token_hash",)


@admin.register(AgentToken)
class AgentTokenAdmin(TokenAdmin):
    list_display = _token_columns("agent")


@admin.register(PersonalToken)
class PersonalTokenAdmin(TokenAdmin):
    list_display = _token_columns("user")


register_read_only(
    {
        # Agents (their owner is the basis of separation of duties) and auto-approve rules
        # change only through audited services (the Tokens and Rules pages), never here.
        Agent: {
            "list_display": ("name", "owner", "is_active", "created_at"),
            "search_fields": ("name",),
        },
        AutoApproveRule: {
            "list_display": ("kind", "name_prefix", "agent", "enabled", "description"),
        },
        # Claims change only through the audited claims service.
        Claim: {"list_display": ("subject", "subject_id", "holder", "taken_at", "expires_at")},
        # Grants change only through the audited grants service (decision, revoke).
        Grant: {
            "list_display": ("id", "kind", "operation", "name_prefix", "scope", "used", "uses"),
            "list_filter": ("scope", "operation"),
        },
        Run: {
            "list_display": ("id", "agent", "status", "created_at", "expires_at"),
            "list_filter": ("status",),
            "exclude": ("token_hash",),
        },
        Action: {
            "list_display": ("id", "run", "kind", "name", "operation", "status", "created_at"),
            "list_filter": ("status", "operation"),
        },
        Approval: {
            "list_display": ("id", "subject", "status", "quorum", "expires_at"),
            "list_filter": ("status", "subject"),
        },
        ApprovalDecision: {
            "list_display": ("approval", "person", "decision", "created_at"),
        },
        Operation: {
            "list_display": ("id", "action", "fence", "status", "result_version", "undo_deadline"),
            "list_filter": ("status",),
        },
        IdempotencyRecord: {
            "list_display": ("agent", "person", "key", "status", "response_status", "expires_at"),
            "exclude": ("response_body",),
        },
        # Plans move only through their services (proposal, approval, the engine).
        Plan: {
            "list_display": ("id", "run", "agent", "status", "created_at", "ended_at"),
            "list_filter": ("status",),
        },
        PlanStep: {
            "list_display": ("plan", "position", "kind", "name", "operation", "status"),
            "list_filter": ("status", "compensation_status"),
        },
    }
)
