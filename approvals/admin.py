from __future__ import annotations

from django.contrib import admin

from approvals.models import (
    Action,
    Agent,
    AgentToken,
    Approval,
    ApprovalDecision,
    AutoApproveRule,
    IdempotencyRecord,
    Operation,
    PersonalToken,
    Plan,
    PlanStep,
    Run,
)
from console.admin import ReadOnlyAdmin


# Agents (their owner is the basis of separation of duties) and auto-approve rules
# change only through audited services (the Tokens and Rules pages), never here.
@admin.register(Agent)
class AgentAdmin(ReadOnlyAdmin):
    list_display = ("name", "owner", "is_active", "created_at")
    search_fields = ("name",)


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


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ("id", "agent", "status", "created_at", "expires_at")
    list_filter = ("status",)
    exclude = ("token_hash",)


@admin.register(Action)
class ActionAdmin(ReadOnlyAdmin):
    list_display = ("id", "run", "kind", "name", "operation", "status", "created_at")
    list_filter = ("status", "operation")


@admin.register(Approval)
class ApprovalAdmin(ReadOnlyAdmin):
    list_display = ("id", "subject", "status", "quorum", "expires_at")
    list_filter = ("status", "subject")


@admin.register(ApprovalDecision)
class ApprovalDecisionAdmin(ReadOnlyAdmin):
    list_display = ("approval", "person", "decision", "created_at")


@admin.register(AutoApproveRule)
class AutoApproveRuleAdmin(ReadOnlyAdmin):
    list_display = ("kind", "name_prefix", "agent", "enabled", "description")


@admin.register(Operation)
class OperationAdmin(ReadOnlyAdmin):
    list_display = ("id", "action", "fence", "status", "result_version", "undo_deadline")
    list_filter = ("status",)


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdmin):
    list_display = ("agent", "person", "key", "status", "response_status", "expires_at")
    exclude = ("response_body",)


# Plans move only through their services (proposal, approval, the engine): looked at here.
@admin.register(Plan)
class PlanAdmin(ReadOnlyAdmin):
    list_display = ("id", "run", "agent", "status", "created_at", "ended_at")
    list_filter = ("status",)


@admin.register(PlanStep)
class PlanStepAdmin(ReadOnlyAdmin):
    list_display = ("plan", "position", "kind", "name", "operation", "status")
    list_filter = ("status", "compensation_status")
