"""The plan tools' side of `airlock-mcp`: the model's steps, in `propose_write`'s
vocabulary, turned into the API's plan steps, and a plan told as what happened to each
step and what to do next."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver.exceptions import ToolError

from airlock_client._protocol import plan_step
from airlock_client.models import Action, Plan, PlanStep

_METHOD_OF = {"replace": "PUT", "merge_patch": "PATCH", "delete": "DELETE", "create": "PUT"}


def plan_steps_json(
    steps: list[dict[str, Any]], read_etags: dict[str, str]
) -> list[dict[str, Any]]:
    """The model's steps (propose_write's vocabulary) as the API's plan steps, each based
    on the version last read; a step that cannot be sent is a ToolError naming it."""
    built: list[dict[str, Any]] = []
    for position, given in enumerate(steps, start=1):
        if not isinstance(given, dict):
            raise ToolError(f"step {position}: must be an object with resource and operation.")
        resource = str(given.get("resource") or "")
        operation = str(given.get("operation") or "")
        if operation not in _METHOD_OF:
            raise ToolError(
                f"step {position}: operation must be replace, merge_patch, delete or create."
            )
        etag = given.get("base_etag") or read_etags.get(resource)
        if operation != "create" and not etag:
            raise ToolError(
                f"step {position}: read {resource} with read_resource first: a step must be "
                "based on the version you read."
            )
        method = _METHOD_OF[operation]
        document = given.get("document")
        if method != "DELETE" and document is None:
            raise ToolError(f"step {position}: operation {operation!r} needs a document.")
        if method == "PATCH" and not isinstance(document, dict):
            raise ToolError(f"step {position}: a merge_patch document must be a JSON object.")
        compensation = given.get("compensation")
        try:
            built.append(
                plan_step(
                    resource,
                    method,
                    etag=None if operation == "create" else str(etag),
                    document=document if method == "PUT" else None,
                    patch=document if method == "PATCH" else None,
                    create=operation == "create",
                    compensation=_compensation_json(position, compensation),
                )
            )
        except ValueError as exc:
            raise ToolError(f"step {position}: {exc}") from exc
    return built


def _compensation_json(position: int, given: Any) -> dict[str, Any] | None:
    if given is None:
        return None
    operation = given.get("operation") if isinstance(given, dict) else None
    if operation not in ("replace", "merge_patch", "delete"):
        raise ToolError(
            f"step {position}: compensation needs operation replace, merge_patch or delete."
        )
    method = _METHOD_OF[operation]
    body: dict[str, Any] = {"method": method}
    if method != "DELETE":
        body["document" if method == "PUT" else "patch"] = given.get("document")
    return body


def write_fields(write: Action | PlanStep) -> dict[str, Any]:
    """What an action and a plan step both tell the model: the write, where it stands."""
    fields = {"resource": write.resource, "operation": write.operation, "status": write.status}
    return {**fields, "based_on": write.observed_etag, "conflict_class": write.conflict_class}


def _plan_step_view(step: PlanStep) -> dict[str, Any]:
    view: dict[str, Any] = {"step": step.position, **write_fields(step)}
    if step.action_id:
        view["action"] = step.action_id
    if step.result_etag:
        view["result_etag"] = step.result_etag
    # Always shown: the method says whether it is the step's undo or the agent's own write.
    view["compensation"] = step.compensation
    if step.error:
        view["error"] = step.error
    return view


def _plan_next(plan: Plan) -> str:
    error = plan.error or {}
    failed = f"step {error.get('step')} ({error.get('resource')}) failed: {error.get('code')}"
    approval = plan.approval or {}
    if plan.status == "pending_approval":
        return (
            f"Still pending: a person approves the plan as one ({approval.get('approvals', 0)} "
            f"of {approval.get('quorum', 1)} approvals so far). Call wait_for_plan again."
        )
    if plan.status == "executing":
        return "Still pending: the steps are being applied in order. Call wait_for_plan again."
    if plan.status == "compensating":
        return (
            f"Still pending: {failed}; the applied steps before it are being compensated in "
            "reverse. Call wait_for_plan again."
        )
    if plan.applied:
        done = ", ".join(f"{s.resource} at {s.result_etag}" for s in plan.steps)
        return f"Applied: every step, in order ({done})."
    if plan.compensated:
        return (
            f"Not applied: {failed}. The steps before it were compensated (their resources "
            "hold their previous documents again, at new versions). Re-read the resources "
            "and re-plan on what you read, or stop."
        )
    if plan.partially_compensated:
        return (
            f"{failed}. Some compensations found a later change and became conflicts "
            f"{plan.conflicts} that a person decides; do not write those resources. Call "
            "wait_for_plan to see the outcome."
        )
    if plan.status == "rejected":
        comment = error.get("comment") or ""
        return (
            f"Rejected by {error.get('by') or 'a person'}"
            + (f": {comment!r}" if comment else "")
            + ". Nothing was written; re-plan with the comment in mind, or stop."
        )
    if plan.status == "expired":
        return "Nobody approved the plan in time; nothing was written."
    if plan.status == "cancelled":
        return "The run ended before the plan was approved; nothing was written."
    if plan.status == "superseded":
        return (
            f"A person approved this plan with a step edited: plan {plan.superseded_by} "
            "replaced it and nothing of this one ran. Call wait_for_plan with that id."
        )
    return f"The plan is {plan.status}."


def plan_view(plan: Plan) -> dict[str, Any]:
    view: dict[str, Any] = {
        "plan": plan.id,
        "status": plan.status,
        "reason": plan.reason,
        "steps": [_plan_step_view(step) for step in plan.steps],
    }
    if plan.approval:
        view["approval"] = plan.approval
    if plan.error:
        view["error"] = plan.error
    if plan.replayed:
        view["replayed"] = True
    if plan.superseded_by:
        view["superseded_by"] = plan.superseded_by
    if plan.edited:
        # Applied as a person edited it, not as you proposed it: see the step and diff.
        view["edited"] = plan.edited
    view["next"] = _plan_next(plan)
    return view
