"""The one JSON shape of each object the API returns: run, action, approval,
auto-approve rule. Handlers and the resource writes (ownership/api) render
through these, so a member is added in one place."""

from __future__ import annotations

import enum
import functools
import json
import uuid
from datetime import UTC, datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import BooleanField, JSONField, QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpResponse

from approvals.models import (
    Action,
    Approval,
    ApprovalDecision,
    ApprovalStatus,
    ApprovalSubject,
    AutoApproveRule,
    Decision,
    Operation,
    PlanStep,
    Run,
)
from approvals.selectors import plan_step_resources
from approvals.services.plans import plan_step_preview
from approvals.services.runs import run_effective_status
from approvals.services.undo import undo_status
from console.api_support import iso, json_bytes, json_response
from console.compiled_query import CompiledQuery, Param
from engine.core.errors import NotFound
from ownership.diff import proposed_document, three_way_diff
from ownership.models import Conflict, ConflictClass, Resource


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


# The facts an action's JSON shows beyond its row, each one correlated subquery of the
# action's row ("approvals_action"). Written as SQL once, not built with the ORM per request:
# building and compiling five ORM subqueries cost ~10x the read itself (py-spy, issue 11).
# `{obj}` is the vendor's JSON object constructor (PostgreSQL jsonb_build_object, SQLite
# json_object: the embedded default); timestamps come back as ISO text (see _moment).
_FACTS_SQL = {
    "_own_approval": """(SELECT {obj}('id', ap.id, 'status', ap.status, 'quorum', ap.quorum,
        'decided_at', ap.decided_at, 'from_conflict', ap.from_conflict_id,
        'resolved_by', u.{username}, 'votes', {votes})
      FROM {approval} ap
      LEFT JOIN {conflict} c ON c.id = ap.from_conflict_id
      LEFT JOIN {user} u ON u.id = c.resolved_by_id
      WHERE ap.action_id = {action}.id ORDER BY ap.created_at DESC LIMIT 1)""",
    "_run_approval": """(SELECT {obj}('id', ap.id, 'quorum', ap.quorum, 'votes', {votes})
      FROM {approval} ap
      WHERE ap.run_id = {action}.run_id AND ap.subject = {run_subject}
      ORDER BY ap.created_at DESC LIMIT 1)""",
    "_write_conflict": """(SELECT {obj}('id', c.id, 'base_version', c.base_version,
        'current_version', c.current_version, 'conflict_class', c.conflict_class_id,
        'class_resolver', k.resolver, 'resolver', c.resolver, 'status', c.status,
        'resolution', c.resolution, 'resolution_action', c.resolution_action_id)
      FROM {conflict} c JOIN {conflict_class} k ON k.slug = c.conflict_class_id
      WHERE c.action_id = {action}.id AND c.origin = 'write'
      ORDER BY c.created_at DESC LIMIT 1)""",
    "_execution": """(SELECT {obj}('fence', o.fence, 'status', o.status,
        'result_version', o.result_version, 'finished_at', o.finished_at,
        'undo_deadline', o.undo_deadline)
      FROM {operation} o
      WHERE o.action_id = {action}.id AND o.undo_of_id IS NULL
      ORDER BY o.started_at DESC LIMIT 1)""",
    "_undo_requested": """EXISTS (SELECT 1 FROM {operation} o
      WHERE o.action_id = {action}.id AND o.undo_of_id IS NOT NULL)""",
}
# An approval's votes, oldest first, as [[username, decision], ...] (NULL or [] when none):
# the names the JSON shows (and how many approved) come with the row, not in a read of their
# own. SQLite's
# json_group_array keeps its subquery's order; its value arrives as text (see _voters).
_VOTES_SQL = {
    "postgresql": """(SELECT jsonb_agg(jsonb_build_array(vu.{username}, d.decision)
        ORDER BY d.created_at)
      FROM {decision} d JOIN {user} vu ON vu.id = d.person_id WHERE d.approval_id = ap.id)""",
    "sqlite": """(SELECT json_group_array(json_array(v.name, v.decision)) FROM
      (SELECT vu.{username} AS name, d.decision AS decision FROM {decision} d
       JOIN {user} vu ON vu.id = d.person_id WHERE d.approval_id = ap.id
       ORDER BY d.created_at) v)""",
}


@functools.cache
def _facts_sql(vendor: str) -> dict[str, str]:
    quote = connection.ops.quote_name
    user = get_user_model()
    username: Any = user._meta.get_field(user.USERNAME_FIELD)  # a concrete Field
    names = {
        "obj": "jsonb_build_object" if vendor == "postgresql" else "json_object",
        "action": quote(Action._meta.db_table),
        "approval": quote(Approval._meta.db_table),
        "decision": quote(ApprovalDecision._meta.db_table),
        "conflict": quote(Conflict._meta.db_table),
        "conflict_class": quote(ConflictClass._meta.db_table),
        "operation": quote(Operation._meta.db_table),
        "user": quote(user._meta.db_table),
        "username": quote(username.column),
        # A literal, not a parameter: the poll runs as a prepared statement (the fast path
        # prepares it; Django's server-side binding does after 5 runs), and PostgreSQL's
        # generic plan of it can use the partial index approval_of_run (WHERE subject =
        # 'run') only if the statement names that literal. With a parameter, once a run had
        # thousands of call approvals the generic plan read them one by one and PostgreSQL
        # planned every poll afresh instead: ~0.74 ms a statement against 0.18 at 5,000
        # (tests/test_api_poll_run_approvals.py checks both plans use the index). A code
        # constant, so nothing to escape.
        "run_subject": f"'{ApprovalSubject.RUN.value}'",
    }
    names["votes"] = _VOTES_SQL["postgresql" if vendor == "postgresql" else "sqlite"].format(
        **names
    )
    return {name: sql.format(**names) for name, sql in _FACTS_SQL.items()}


def body_facts(vendor: str) -> list[tuple[str, str]]:
    """(attribute, SQL) of each fact an action's JSON shows beyond its row: what
    with_body_facts annotates, and what the poll's fast path selects beside the row
    (approvals/api/fastpoll.py). The SQL takes no parameters (see `_facts_sql`)."""
    return list(_facts_sql(vendor).items())


def with_body_facts(actions: QuerySet[Action]) -> QuerySet[Action]:
    """`actions` with everything an action's JSON shows, in ONE statement: the run and
    its agent joined, and the write conflict, the latest approval (the action's own, and
    the run's), the latest execution and whether an undo was ever requested as
    correlated subqueries. The poll's 200 costs this one read (plus the token's)."""
    facts: dict[str, Any] = {
        # Constant SQL: table names from the models' metadata, one code constant.
        name: RawSQL(  # noqa: S611
            sql,
            (),
            output_field=BooleanField() if name == "_undo_requested" else JSONField(),
        )
        for name, sql in body_facts(connection.vendor)
    }
    return actions.select_related("run__agent").annotate(**facts)


# Built and compiled once a process (per database vendor): building the statement with its
# five subqueries cost more CPU than running it (issue 41).
_ACTION_WITH_BODY_FACTS = CompiledQuery(
    lambda: with_body_facts(Action.objects.filter(pk=Param("id", Action._meta.get_field("id"))))
)


def action_load(action_id: Any) -> Action:
    """The action with what its JSON shows, fresh from the database (one statement)."""
    action: Action = _ACTION_WITH_BODY_FACTS.get(id=action_id)
    return action


def _facts(action: Action, name: str) -> Any:
    """An annotation of `with_body_facts`; loading without it is a programming error."""
    try:
        return getattr(action, name)
    except AttributeError as exc:
        raise TypeError("render actions loaded through with_body_facts()") from exc


def action_json(action: Action) -> dict[str, Any]:
    conflict: dict[str, Any] | None = _facts(action, "_write_conflict")
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
        "execution": _execution_info(_facts(action, "_execution")),
        "conflict": _conflict_info(action, conflict),
        "resolution": (conflict["resolution"] or None) if conflict else None,
        "resolution_action": (
            str(uuid.UUID(str(conflict["resolution_action"])))
            if conflict and conflict["resolution_action"]
            else None
        ),
        "parent": str(action.parent_id) if action.parent_id else None,
        "superseded_by": _superseded_by(action),
        "edited": _edited(action),
        # Rarely requested: only then does the undo's state cost its own reads.
        "undo": undo_status(action) if _facts(action, "_undo_requested") else None,
        "error": action.error if isinstance(action.error, dict) else None,
        "url": f"/api/v1/actions/{action.pk}",
        "created_at": iso(action.created_at),
        "updated_at": iso(action.updated_at),
    }


def _superseded_by(action: Action) -> dict[str, str] | None:
    """A `superseded` action's link to the edited action approved in its place."""
    if action.superseded_by_id is None:
        return None
    return {"id": str(action.superseded_by_id), "url": f"/api/v1/actions/{action.superseded_by_id}"}


def _edited(action: Action) -> dict[str, Any] | None:
    """Who edited the agent's proposal into this action, the action it replaced and the
    diff: recorded on the row when the edit was approved (approvals/services/edits.py)."""
    edit = action.edit
    if not isinstance(edit, dict):
        return None
    return {
        "by": edit.get("by"),
        "supersedes": edit.get("supersedes"),
        "comment": edit.get("comment") or "",
        "diff": edit.get("diff") or [],
    }


def action_body(action: Action) -> bytes:
    return json_bytes(action_json(action))


def action_response(action: Action, *, status: int = 200) -> HttpResponse:
    """The action with its ETag; a 202 (an accepted write or undo) also says where it is."""
    headers = {"ETag": action.etag}
    if status == 202:
        headers = {"Location": f"/api/v1/actions/{action.pk}", **headers}
    return json_response(action_json(action), status=status, headers=headers)


def _moment(value: str | None) -> str | None:
    """A timestamp as PostgreSQL's JSON wrote it, in the API's (Python's isoformat) form."""
    if not value:
        return None
    moment = datetime.fromisoformat(value)
    # SQLite (the embedded default) writes naive UTC.
    return iso(moment if moment.tzinfo else moment.replace(tzinfo=UTC))


def _conflict_info(action: Action, conflict: dict[str, Any] | None) -> dict[str, Any] | None:
    if conflict is None:
        return None
    return {
        "conflict_id": str(uuid.UUID(str(conflict["id"]))),
        "resource": action.resource_identifier,
        "expected_etag": f'"{conflict["base_version"]}"',
        "current_etag": f'"{conflict["current_version"]}"',
        "conflict_class": conflict["conflict_class"],
        "resolver": conflict["resolver"],
        "retryable_by_agent": ConflictClass(resolver=conflict["class_resolver"]).retryable_by_agent,
        "status": conflict["status"],
    }


def _approval_info(action: Action) -> dict[str, Any]:
    approval: dict[str, Any] | None = _facts(action, "_own_approval")
    if approval is None:
        return _run_approval_info(action.run, _facts(action, "_run_approval"))
    votes = _voters(approval)
    approvers = [name for name, decision in votes if decision == Decision.APPROVE]
    rejecter = next((name for name, decision in votes if decision == Decision.REJECT), None)
    by: str | None = rejecter if approval["status"] == ApprovalStatus.REJECTED else None
    if by is None and approvers:
        by = ", ".join(approvers)
    if by is None and approval["from_conflict"] is not None:
        by = approval["resolved_by"]
    return {
        "mode": "per_call",
        "decision": approval["status"],
        "by": by,
        "at": _moment(approval["decided_at"]),
        "approval_id": str(uuid.UUID(str(approval["id"]))),
        "approvals_so_far": len(approvers),
        "quorum": approval["quorum"],
    }


def _voters(approval: dict[str, Any]) -> list[tuple[str, str]]:
    """(username, decision) of the approval's votes, oldest first, from its body fact."""
    votes = approval.get("votes") or []
    if isinstance(votes, str):  # SQLite: the aggregate comes back as JSON text
        votes = json.loads(votes)
    return [(str(name), str(decision)) for name, decision in votes]


def _run_approval_info(run: Run, approval: dict[str, Any] | None) -> dict[str, Any]:
    """An action without its own approval was approved with its run."""
    votes = _voters(approval) if approval is not None else []
    approvers = [name for name, decision in votes if decision == Decision.APPROVE]
    quorum = approval["quorum"] if approval is not None else 1
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


def _execution_info(operation: dict[str, Any] | None) -> dict[str, Any] | None:
    if operation is None:
        return None
    result_version = operation["result_version"]
    return {
        "fence": operation["fence"],
        "status": operation["status"],
        "result_etag": f'"{result_version}"' if result_version is not None else None,
        "finished_at": _moment(operation["finished_at"]),
        "undo_deadline": _moment(operation["undo_deadline"]),
    }


# --- Approvals -------------------------------------------------------------------------


class _Unread(enum.Enum):
    UNREAD = "unread"


# approval_json's `call_resource` when the caller has not read the call's resource.
UNREAD = _Unread.UNREAD


def approval_json(
    approval: Approval,
    *,
    approvals_so_far: int | None = None,
    call_resource: Resource | _Unread | None = UNREAD,
) -> dict[str, Any]:
    """`approvals_so_far`: the approving votes, when the caller counted them already;
    `call_resource`: the resource a call approval's action writes (None: no such row),
    when the caller read it already."""
    if approvals_so_far is None:
        approvals_so_far = approval.decisions.filter(decision=Decision.APPROVE).count()
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
        "approvals_so_far": approvals_so_far,
        "quorum": approval.quorum,
        "expires_at": iso(approval.expires_at),
        "status": approval.status,
        "created_at": iso(approval.created_at),
    }
    if approval.action is not None:
        item.update(_approval_call(approval, approval.action, call_resource))
    item["plan"] = str(approval.plan_id) if approval.plan_id else None
    if approval.plan_id is not None:
        steps = list(PlanStep.objects.filter(plan_id=approval.plan_id).order_by("position"))
        resources = plan_step_resources(steps)
        item["steps"] = [
            _approval_plan_step(step, resources.get((step.kind_id, step.name))) for step in steps
        ]
    return item


def _approval_plan_step(step: PlanStep, resource: Resource | None) -> dict[str, Any]:
    """What a plan approval shows of one step: the write, its diff against the
    resource now, and its compensation."""
    live = resource is not None and not resource.deleted
    current = resource.document if resource is not None and live else {}
    return {
        "position": step.position,
        "resource": step.resource_identifier,
        "operation": step.operation,
        "conflict_class": step.conflict_class_id,
        "observed_etag": None if step.observed_version is None else f'"{step.observed_version}"',
        "current_etag": resource.etag if resource is not None and live else None,
        "diff": [
            {"path": row["path"], "current": row["current"], "proposed": row["proposed"]}
            for row in three_way_diff(current, current, proposed_document(step, current))
        ],
        "compensation": (step.compensation or {}).get("method", "undo"),
        **_approval_plan_step_writes(step, resource),
    }


def _approval_plan_step_writes(step: PlanStep, resource: Resource | None) -> dict[str, Any]:
    """What the approver approves of a step beyond its diff against the resource now:
    its document or patch, and its compensation's (the write it is, its class), each
    as a diff against the version the agent observed (approvals/services/plans.py)."""
    preview = plan_step_preview(step, resource)
    given = step.compensation if isinstance(step.compensation, dict) else {}
    payload_key = {"replace": "document", "merge_patch": "patch"}.get(step.payload_format)
    return {
        **({payload_key: step.payload} if payload_key else {}),
        "observed_diff": preview.diff,
        "compensation_write": {
            "method": given.get("method", "undo"),
            **{key: given[key] for key in ("document", "patch") if key in given},
            "operation": given.get("operation"),
            "conflict_class": given.get("conflict_class"),
            "deletes": preview.compensation_deletes,
            "diff": preview.compensation_diff,
        },
    }


def _approval_call(
    approval: Approval, action: Action, known: Resource | _Unread | None
) -> dict[str, Any]:
    """What a call approval adds: the write, and its diff against the resource now."""
    resource = (
        Resource.objects.filter(kind_id=action.kind_id, name=action.name).first()
        if known is UNREAD
        else known
    )
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


# --- Auto-approve rules ------------------------------------------------------------------


def rule_load(rule_id: int) -> AutoApproveRule:
    rule = AutoApproveRule.objects.select_related("agent").filter(pk=rule_id).first()
    if rule is None:
        raise NotFound(f"Auto-approve rule {rule_id} not found.")
    return rule
