"""The one JSON shape of each object the API returns: run, action, approval,
auto-approve rule. Handlers and the resource writes (ownership/api) render
through these, so a member is added in one place."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse

from approvals.models import (
    Action,
    Approval,
    ApprovalStatus,
    ApprovalSubject,
    AutoApproveRule,
    Decision,
    Operation,
    Run,
)
from approvals.services.runs import run_effective_status
from approvals.services.undo import undo_status
from console.api_support import iso, json_bytes, json_response
from console.core.errors import NotFound
from ownership.diff import proposed_document, three_way_diff
from ownership.models import Conflict, Resource


def run_json(run: Run) -> dict[str, Any]:
    return {
        "id": str(run.pk),
        "status": run_effective_status(run),
        "agent": run.agent.name,
        "task": run.task,
        "write_set": run.write_set,
        "ttl_seconds": run.ttl_seconds,
        "expires_at": iso(run.expires_at),
        "max_expires_at": iso(run.max_expires_at),
        "auto_approved": run.auto_approved,
        "status_reason": run.status_reason,
        "created_at": iso(run.created_at),
        "activated_at": iso(run.activated_at),
        "ended_at": iso(run.ended_at),
        "url": f"/api/v1/runs/{run.pk}",
    }


# --- Actions -------------------------------------------------------------------------


def action_load(action_id: Any) -> Action:
    """The action with what its JSON shows, fresh from the database."""
    return Action.objects.select_related("kind", "conflict_class", "run__agent").get(pk=action_id)


def action_json(action: Action) -> dict[str, Any]:
    conflict = (
        Conflict.objects.filter(action=action, origin="write")
        .select_related("conflict_class")
        .first()
    )
    return {
        "id": str(action.pk),
        "run": str(action.run_id),
        "agent": action.run.agent.name,
        "resource": action.resource_identifier,
        "operation": action.operation,
        "status": action.status,
        "etag": action.etag,
        "observed_etag": action.observed_etag,
        "conflict_class": action.conflict_class_id,
        "reason": action.reason,
        "paused_reason": action.paused_reason,
        "approval": _approval_info(action),
        "execution": _execution_info(action),
        "conflict": _conflict_info(action, conflict),
        "resolution": (conflict.resolution or None) if conflict else None,
        "resolution_action": (
            str(conflict.resolution_action_id)
            if conflict and conflict.resolution_action_id
            else None
        ),
        "parent": str(action.parent_id) if action.parent_id else None,
        "undo": undo_status(action),
        "error": action.error if isinstance(action.error, dict) else None,
        "url": f"/api/v1/actions/{action.pk}",
        "created_at": iso(action.created_at),
        "updated_at": iso(action.updated_at),
    }


def action_body(action: Action) -> bytes:
    return json_bytes(action_json(action))


def action_response(action: Action, *, status: int = 200) -> HttpResponse:
    """The action with its ETag; a 202 (an accepted write or undo) also says where it is."""
    headers = {"ETag": action.etag}
    if status == 202:
        headers = {"Location": f"/api/v1/actions/{action.pk}", **headers}
    return json_response(action_json(action), status=status, headers=headers)


def _conflict_info(action: Action, conflict: Conflict | None) -> dict[str, Any] | None:
    if conflict is None:
        return None
    return {
        "conflict_id": str(conflict.pk),
        "resource": action.resource_identifier,
        "expected_etag": f'"{conflict.base_version}"',
        "current_etag": f'"{conflict.current_version}"',
        "conflict_class": conflict.conflict_class_id,
        "resolver": conflict.resolver,
        "retryable_by_agent": conflict.conflict_class.retryable_by_agent,
        "status": conflict.status,
    }


def _approval_info(action: Action) -> dict[str, Any]:
    approval = Approval.objects.filter(action=action).order_by("-created_at").first()
    if approval is None:
        return _run_approval_info(action.run)
    votes = list(approval.decisions.select_related("person").order_by("created_at"))
    approvers = [v.person.get_username() for v in votes if v.decision == Decision.APPROVE]
    rejecter = next((v.person.get_username() for v in votes if v.decision == Decision.REJECT), None)
    by: str | None = rejecter if approval.status == ApprovalStatus.REJECTED else None
    if by is None and approvers:
        by = ", ".join(approvers)
    if by is None and approval.from_conflict_id is not None:
        conflict = approval.from_conflict
        by = conflict.resolved_by.get_username() if conflict and conflict.resolved_by else None
    return {
        "mode": "per_call",
        "decision": approval.status,
        "by": by,
        "at": iso(approval.decided_at),
        "approval_id": str(approval.pk),
        "approvals_so_far": len(approvers),
        "quorum": approval.quorum,
    }


def _run_approval_info(run: Run) -> dict[str, Any]:
    """An action without its own approval was approved with its run."""
    approvers, quorum = _run_votes(run)
    return {
        "mode": "per_run",
        "decision": "approved" if run.activated_at else "pending",
        "by": "auto-approve" if run.auto_approved else (", ".join(approvers) or None),
        "at": iso(run.activated_at),
        "approval_id": None,
        # An auto-approved run counts its rule as its one approval.
        "approvals_so_far": 1 if run.auto_approved and run.activated_at else len(approvers),
        "quorum": quorum,
    }


def _run_votes(run: Run) -> tuple[list[str], int]:
    """Who approved the run (so far) and the quorum its approval asks for."""
    approval = (
        Approval.objects.filter(run=run, subject=ApprovalSubject.RUN)
        .order_by("-created_at")
        .first()
    )
    if approval is None:
        return [], 1
    names = [
        d.person.get_username()
        for d in approval.decisions.select_related("person")
        .filter(decision=Decision.APPROVE)
        .order_by("created_at")
    ]
    return names, approval.quorum


def _execution_info(action: Action) -> dict[str, Any] | None:
    operation = (
        Operation.objects.filter(action=action, undo_of__isnull=True)
        .order_by("-started_at")
        .first()
    )
    if operation is None:
        return None
    return {
        "fence": operation.fence,
        "status": operation.status,
        "result_etag": (
            f'"{operation.result_version}"' if operation.result_version is not None else None
        ),
        "finished_at": iso(operation.finished_at),
        "undo_deadline": iso(operation.undo_deadline),
    }


# --- Approvals -------------------------------------------------------------------------


def approval_json(approval: Approval) -> dict[str, Any]:
    run = approval.run
    item: dict[str, Any] = {
        "id": str(approval.pk),
        "subject": approval.subject,
        "run": str(run.pk),
        "action": str(approval.action_id) if approval.action_id else None,
        "agent": run.agent.name,
        "task": run.task,
        "write_set": run.write_set if approval.subject == ApprovalSubject.RUN else None,
        "resource": None,
        "operation": None,
        "conflict_class": None,
        "diff": None,
        "observed_etag": None,
        "current_etag": None,
        "approvals_so_far": approval.decisions.filter(decision=Decision.APPROVE).count(),
        "quorum": approval.quorum,
        "expires_at": iso(approval.expires_at),
        "status": approval.status,
        "created_at": iso(approval.created_at),
    }
    if approval.action is not None:
        item.update(_approval_call(approval, approval.action))
    return item


def _approval_call(approval: Approval, action: Action) -> dict[str, Any]:
    """What a call approval adds: the write, and its diff against the resource now."""
    resource = Resource.objects.filter(kind_id=action.kind_id, name=action.name).first()
    live = resource is not None and not resource.deleted
    current = resource.document if resource is not None and live else {}
    proposed = proposed_document(action, current)
    return {
        "resource": action.resource_identifier,
        "operation": action.operation,
        "conflict_class": action.conflict_class_id,
        "observed_etag": (
            f'"{approval.observed_version}"' if approval.observed_version is not None else None
        ),
        "current_etag": resource.etag if resource is not None and live else None,
        "diff": [
            {"path": row["path"], "current": row["current"], "proposed": row["proposed"]}
            for row in three_way_diff(current, current, proposed)
        ],
    }


def approval_load(approval_id: Any) -> Approval:
    return Approval.objects.select_related(
        "run__agent", "action__kind", "action__conflict_class"
    ).get(pk=approval_id)


# --- Auto-approve rules ------------------------------------------------------------------


def rule_load(rule_id: int) -> AutoApproveRule:
    rule = AutoApproveRule.objects.select_related("agent").filter(pk=rule_id).first()
    if rule is None:
        raise NotFound(f"Auto-approve rule {rule_id} not found.")
    return rule
