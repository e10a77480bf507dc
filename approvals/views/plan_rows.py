"""What the console shows of a plan's steps: one row per step with its diff and its
compensation. Shared by the plan page and the approvals inbox (no view here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from approvals.models import PlanStep, PlanStepStatus
from approvals.selectors import plan_step_resources
from approvals.services.plans import StepPreview, plan_step_preview
from ownership.diff import DocumentDiff, document_diff_view
from ownership.history import revision_at
from ownership.models import Conflict, ConflictOrigin, Resource


@dataclass(frozen=True)
class StepRow:
    step: PlanStep
    resource: Resource | None  # the resource as it is now (None: not created yet)
    current_version: str | None
    version_moved: bool  # pending: the resource moved past the version the agent read
    diff: list[dict[str, Any]]
    diff_label: str
    compensation_method: str  # "undo" (the default) or the agent's PUT/PATCH/DELETE
    compensation_payload: Any
    compensation_class: str  # an explicit compensation's class ("" for the undo)
    # What the compensation leaves, against the version the agent observed.
    compensation_diff: list[dict[str, Any]]
    compensation_deletes: bool
    observed_recorded: bool
    forward_conflict: Conflict | None
    undo_conflict: Conflict | None
    # Approve with one step edited (approvals/services/plan_edits.py): the step's document
    # or merge patch as the agent proposed it, prefilled in the inbox's form ("" a delete).
    edit_text: str = ""


def _version_document(resource: Resource | None, version: str | None) -> dict[str, Any] | None:
    """The document a version held ({} for a tombstone), None when it is not recorded."""
    if resource is None or version is None:
        return None
    row = revision_at(resource, version)
    if row is None:
        return None
    return {} if row.deleted or not isinstance(row.document, dict) else row.document


def _diff(
    step: PlanStep, resource: Resource | None, preview: StepPreview
) -> tuple[list[dict[str, Any]], str]:
    """An applied step shows what it changed (its base version → its result); any
    other step shows its payload against the version the agent observed."""
    applied = step.applied_operation
    if step.status == PlanStepStatus.APPLIED and applied is not None:
        after = _version_document(resource, applied.result_version)
        if after is not None:
            before = _version_document(resource, applied.base_version) or {}
            label = f"What it changed (version {applied.base_version or '(none)'} → "
            diff = document_diff_view(
                before,
                after,
                before_label=f"Version {applied.base_version or '(none)'}",
                after_label=f"Version {applied.result_version}",
            )
            return diff, f"{label}{applied.result_version})"
    observed = step.observed_version
    label = "What it changes (" + (
        f"version {observed} the agent observed" if observed is not None else "nothing yet"
    )
    seen = f"Version {observed} (observed)" if observed is not None else "Nothing (a create)"
    diff = DocumentDiff(
        preview.diff,
        before=preview.observed_document,
        after=preview.result,
        before_label=seen,
        after_label="After this step",
    )
    return diff, f"{label} → result of this step)"


def plan_step_rows(
    steps: list[PlanStep], conflicts: dict[tuple[Any, str], Conflict] | None = None
) -> list[StepRow]:
    """Rows for `steps` (ordered by position); `conflicts` is plan_detail's map keyed
    (action_id, origin), to link a step's refusal and its compensation's conflict."""
    found = conflicts or {}
    resources = plan_step_resources(steps)
    rows = []
    for step in steps:
        resource = resources.get((step.kind_id, step.name))
        current_version = resource.token if resource is not None else None
        applied = step.applied_operation
        preview = plan_step_preview(step, resource)
        diff, label = _diff(step, resource, preview)
        compensation = step.compensation or {}
        rows.append(
            StepRow(
                step=step,
                resource=resource,
                current_version=current_version,
                version_moved=step.status == PlanStepStatus.PENDING
                and step.observed_version is not None
                and current_version != step.observed_version,
                diff=diff,
                diff_label=label,
                compensation_method=str(compensation.get("method", "undo")),
                compensation_payload=compensation.get("document", compensation.get("patch")),
                compensation_class=str(compensation.get("conflict_class") or ""),
                compensation_diff=DocumentDiff(
                    preview.compensation_diff,
                    before=preview.observed_document,
                    after=preview.compensation_result,
                    before_label="Observed",
                    after_label="After the compensation",
                ),
                compensation_deletes=preview.compensation_deletes,
                observed_recorded=preview.observed_recorded,
                forward_conflict=found.get((step.action_id, ConflictOrigin.WRITE)),
                undo_conflict=(
                    found.get((applied.action_id, ConflictOrigin.UNDO))
                    if applied is not None
                    else None
                ),
                edit_text=(
                    ""
                    if step.payload is None
                    else json.dumps(step.payload, indent=2, ensure_ascii=False)
                ),
            )
        )
    return rows
