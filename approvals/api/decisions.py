"""API: run and call approvals — list, read, decide."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import uuid
import weakref
from typing import Any, Literal

from django.http import HttpRequest, HttpResponse
from ninja import Query, Router

from approvals.api.schemas import ApprovalItem, ApprovalPage, DecisionIn
from approvals.api.serialize import UNREAD, approval_json
from approvals.outbox import deliveries_held
from approvals.selectors import approval_get_for_person, approval_list_for_person
from approvals.services.decisions import approval_decide_tallied
from console.api_support import (
    OLDEST_FIRST,
    TIME_CURSOR_PATTERN,
    json_response,
    page_response,
    writing_principal,
)
from console.auth import person_token, principal_of
from console.problems import ApiError, errors

router = Router(auth=person_token, tags=["approvals"])


@router.get(
    "/approvals",
    response={200: ApprovalPage, **errors(400, 401, 403, 422)},
    summary="Run and call approvals the caller may decide, oldest first",
)
def approval_list(
    request: HttpRequest,
    status: Literal["pending", "approved", "rejected", "expired", "cancelled"] = "pending",
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=TIME_CURSOR_PATTERN),
) -> HttpResponse:
    # The console's rule: operators decide; escalation groups see escalated calls.
    approvals = approval_list_for_person(principal_of(request).user, status=status)
    return page_response(
        approvals, keyset=OLDEST_FIRST, cursor=cursor, limit=limit, render=approval_json
    )


@router.get(
    "/approvals/{approval_id}",
    response={200: ApprovalItem, **errors(401, 403, 404, 422)},
    summary="Read one approval",
)
def approval_get(request: HttpRequest, approval_id: uuid.UUID) -> HttpResponse:
    approval = approval_get_for_person(principal_of(request).user, approval_id)
    return json_response(approval_json(approval))


def _edit_of(payload: DecisionIn) -> dict[str, Any] | None:
    """approve_with_edits' document or patch (as sent: the service says which is missing);
    the other decisions take neither."""
    edit: dict[str, Any] = {
        name: value
        for name, value in (
            ("document", payload.document),
            ("patch", payload.patch),
            ("step", payload.step),
        )
        if value is not None
    }
    if payload.decision != "approve_with_edits":
        if edit:
            raise ApiError(
                "`document`, `patch` and `step` go with approve_with_edits only.",
                code="validation_error",
                status=422,
                extra={"errors": [{"field": next(iter(edit)), "message": "not expected"}]},
            )
        return None
    return edit


@router.post(
    "/approvals/{approval_id}/decision",
    response={200: ApprovalItem, **errors(400, 401, 403, 404, 409, 413, 422, 429)},
    summary="Approve, reject, or approve with edits (409 if already decided or expired)",
    description="`approve` with `grant` ({uses, ttl_seconds, name_prefix, scope?, reason?}) "
    "also grants standing approval for writes of the same kind and operation under the "
    "prefix (docs/grants.md; 403 when the class forbids grants, the quorum is above one, the "
    "prefix is wider than the run's write set, or `scope: agent` from a non-admin; 422 on "
    "bad values): the grant and the approval are one transaction. "
    "`approve_with_edits` with `document` (or a merge `patch` on the proposed "
    "document) approves an edited version of a single write: a new action, bound to the "
    "same observed version; the original ends `superseded` (its `superseded_by` links the "
    "edited action). The answer is then the edited action's approval (pending when the "
    "quorum needs another person). The edited write is checked as the agent's would be "
    "(403 not_in_write_set, 409 run_not_active, 412 stale_version, 413, 422). On a plan's "
    "approval, `approve_with_edits` also names the `step` (its position) whose `document` or "
    "`patch` this is: the edited plan is a new plan in the same run, every step bound to the "
    "version the agent observed and checked as `POST /runs/{id}/plans` checks it (a refusal "
    "names the `step`; a delete step, an unknown step or no `step` at all: 422); the "
    "original ends `superseded` (its `superseded_by` links the edited plan, whose `edited` "
    "names the editor, the step and the diff), and the answer is the edited plan's "
    "approval, approved (the plan executes) or pending another person when the quorum is "
    "above one.",
)
def approval_decision(
    request: HttpRequest, approval_id: uuid.UUID, payload: DecisionIn
) -> HttpResponse:
    principal = writing_principal(request)
    # The approved action's job is enqueued once the answer is out (its waiters are woken
    # at commit): when the response is closed (after its last byte under ASGI and WSGI;
    # before Django's test client returns it), or, if it never is (the client went away
    # mid-decision), when it is collected. At once if deciding or rendering raises.
    with deliveries_held() as held:
        decided = approval_decide_tallied(
            approval_id=approval_id,
            actor=principal.actor,
            person=principal.user,
            decision=payload.decision,
            comment=payload.comment,
            edit=_edit_of(payload),
            grant=payload.grant.model_dump() if payload.grant is not None else None,
        )
        # Rendered from the rows the decision locked (and, for a call, the resource it
        # read with them): nothing else changes them meanwhile.
        response = json_response(
            approval_json(
                decided.approval,
                approvals_so_far=decided.approvals_so_far,
                call_resource=decided.resource if decided.resource_read else UNREAD,
            )
        )
        response._resource_closers.append(held.deliver)  # type: ignore[attr-defined]
        weakref.finalize(response, held.deliver)
    return response
