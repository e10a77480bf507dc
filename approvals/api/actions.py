"""API: actions — read (long-poll), list, cancel, undo.

Who may read an action is one selector (approvals.selectors.actions_visible_to),
the same the console pages use.
"""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import Field, QuerySet
from django.http import HttpRequest, HttpResponse
from ninja import Query, Router

from approvals.api.longpoll import (
    hold,
    longpoll_read,
    parse_prefer_wait,
    release_connection,
)
from approvals.api.schemas import ActionOut, ActionPage
from approvals.api.serialize import (
    action_body,
    action_json,
    action_load,
    action_response,
    with_body_facts,
)
from approvals.models import FINAL_ACTION_STATUSES, Action
from approvals.selectors import (
    actions_in_token_scope,
    actions_visible_to,
    token_action_scope,
)
from approvals.services import actions as action_services
from approvals.services import idempotency
from approvals.services.preconditions import TagCondition, read_condition
from approvals.services.tokens import Principal
from approvals.services.undo import (
    UNDO_REASON_MAX,
    action_undo_authorise,
    action_undo_request,
)
from audit.services import Actor, audit_deferred
from console.api_support import (
    NEWEST_FIRST,
    TIME_CURSOR_PATTERN,
    conditional_response,
    idempotency_claim,
    page_response,
    rate_limit_writes,
    read_body,
    store_for_replay,
)
from console.auth import (
    any_token,
    any_token_or_ended_run,
    any_token_or_ended_run_deferred,
    principal_of,
    principal_resolve,
    reader_of,
    run_or_person_token,
)
from console.compiled_query import CompiledQuery, Param
from console.problems import ApiError, errors
from engine.core.errors import NotFound

router = Router()


def _visible(principal: Principal, action_id: uuid.UUID) -> Action:
    action = (
        actions_visible_to(reader_of(principal))
        .select_related("kind", "resource", "conflict_class", "run__agent")
        .filter(pk=action_id)
        .first()
    )
    if action is None:
        raise NotFound(f"Action {action_id} not found.")
    return action


# --- Read, with long-poll ------------------------------------------------------------


@dataclass(frozen=True)
class _ScopedReads:
    """A token reader's two reads of one action, compiled once per scope's shape."""

    state: CompiledQuery  # (revision, status)
    body: CompiledQuery  # the action with what its JSON shows (with_body_facts)


_SCOPED_READS: dict[tuple[str, ...], _ScopedReads] = {}


def _scoped_reads(columns: tuple[str, ...]) -> _ScopedReads:
    """The reads for a token scope of these columns (an agent's, a live or an ended run's):
    the same selector as actions_visible_to, its values as `Param`s. Building these two
    querysets per poll was most of the Django path's CPU (issue 41); a person's visibility
    is not column values and stays the ORM's."""
    reads = _SCOPED_READS.get(columns)
    if reads is None:

        def visible() -> QuerySet[Action]:
            scope = {column: Param(column, _column(column)) for column in columns}
            return actions_in_token_scope(scope).filter(pk=Param("id", _column("id")))

        reads = _SCOPED_READS.setdefault(
            columns,
            _ScopedReads(
                state=CompiledQuery(lambda: visible().values_list("revision", "status")),
                body=CompiledQuery(lambda: with_body_facts(visible())),
            ),
        )
    return reads


def _column(name: str) -> Field[Any, Any]:
    field = Action._meta.get_field(name)
    assert isinstance(field, Field)  # a column of the action, not a reverse relation
    return field


def _revision_and_status(reader: Any, action_id: uuid.UUID) -> tuple[int, str] | None:
    scope = token_action_scope(reader)
    if scope is None:
        visible = actions_visible_to(reader).filter(pk=action_id)
        row: tuple[int, str] | None = visible.values_list("revision", "status").first()
        return row
    found: tuple[int, str] | None = _scoped_reads(tuple(scope)).state.first(id=action_id, **scope)
    return found


def _with_body(reader: Any, action_id: uuid.UUID) -> Action | None:
    scope = token_action_scope(reader)
    if scope is None:
        return with_body_facts(actions_visible_to(reader).filter(pk=action_id)).first()
    found: Action | None = _scoped_reads(tuple(scope)).body.first(id=action_id, **scope)
    return found


@dataclass(frozen=True)
class ActionState:
    etag: str
    final: bool
    body: bytes  # empty when the answer will not need it (304, or still holding)


def action_should_hold(state: ActionState, condition: TagCondition | None) -> bool:
    if condition is not None:
        return condition.weak_match(state.etag)
    return not state.final


def _action_state(
    request: HttpRequest,
    action_id: uuid.UUID,
    condition: TagCondition | None,
    holding: bool,
    woken: bool = False,
) -> ActionState:
    """Read the action; build the body only when the answer is a 200 now.

    With If-None-Match (a 304 likely), or a waiter's first read: one indexed read
    of (revision, status), and nothing is serialised while the tag still matches.
    Otherwise (a plain poll, or a waiter woken because the action changed): one
    statement that reads the row with everything its JSON shows (with_body_facts).
    The ETag is the action's revision either way. The token is looked up here too
    (the first call), in the same thread hop as the read.
    """
    try:
        reader = reader_of(principal_resolve(request))
        if condition is not None or (holding and not woken):
            row = _revision_and_status(reader, action_id)
            if row is None:
                raise NotFound(f"Action {action_id} not found.")
            state = ActionState(
                etag=f'"a{row[0]}"', final=row[1] in FINAL_ACTION_STATUSES, body=b""
            )
            if holding and action_should_hold(state, condition):
                return state
            if condition is not None and condition.weak_match(state.etag):
                return state
        action = _with_body(reader, action_id)
        if action is None:
            raise NotFound(f"Action {action_id} not found.")
        state = ActionState(etag=action.etag, final=action.is_final, body=action_body(action))
        if holding and action_should_hold(state, condition):
            return ActionState(etag=state.etag, final=state.final, body=b"")
        return state
    finally:
        release_connection(holding)


@longpoll_read(
    router,
    "/actions/{action_id}",
    out=ActionOut,
    subject="action",
    auth=any_token_or_ended_run_deferred,
    summary="Read an action (long-poll with Prefer: wait=N)",
    description="An agent token or an active run's token reads the agent's actions; the "
    "token of an ended run reads only that run's actions.",
    tags=["actions"],
)
async def action_get(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    try:
        wait = parse_prefer_wait(request.headers.get("Prefer"))
    except ApiError:
        # Authentication answers first (401/403 before a malformed header's 400).
        await sync_to_async(principal_resolve)(request)
        raise
    condition = read_condition(request.headers.get("If-None-Match"))
    read = sync_to_async(_action_state)
    if wait:
        state = await hold(
            channel=action_id,
            run=False,
            wait=wait,
            read=lambda woken: read(request, action_id, condition, True, woken),
            should_hold=lambda state: action_should_hold(state, condition),
        )
    if not wait or not (state.body or (condition and condition.weak_match(state.etag))):
        # No wait, or a wait that ended holding an unfinished action: answer its state.
        state = await read(request, action_id, condition, False)
    return conditional_response(etag=state.etag, body=state.body, condition=condition, wait=wait)


@router.get(
    "/actions",
    auth=any_token,
    response={200: ActionPage, **errors(400, 401, 422)},
    summary="List actions visible to the caller, newest first",
    tags=["actions"],
)
def action_list(
    request: HttpRequest,
    run: uuid.UUID | None = None,
    status: str | None = Query(None, max_length=20),
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=TIME_CURSOR_PATTERN),
) -> HttpResponse:
    actions = with_body_facts(actions_visible_to(reader_of(principal_of(request))))
    if run is not None:
        actions = actions.filter(run_id=run)
    if status:
        actions = actions.filter(status=status)
    return page_response(
        actions, keyset=NEWEST_FIRST, cursor=cursor, limit=limit, render=action_json
    )


# --- Cancel and undo -------------------------------------------------------------------


@router.post(
    "/actions/{action_id}/cancel",
    auth=any_token_or_ended_run,
    response={200: ActionOut, **errors(401, 403, 404, 409, 422, 429)},
    summary="Cancel an action before its execution starts",
    description="With the token of a run that is no longer active: `409 run_not_active`.",
    tags=["actions"],
)
def action_cancel(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    principal = principal_of(request)
    action = _visible(principal, action_id)
    rate_limit_writes(principal)
    # action_cancel decides who may (operator role, own run, active run).
    action = action_services.action_cancel(action=action, actor=principal.actor)
    return action_response(action_load(action.pk))


_UNDO_DOC: dict[str, Any] = {
    "parameters": [
        {
            "in": "header",
            "name": "Idempotency-Key",
            "required": True,
            "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._:-]{8,255}$"},
        },
        {
            "in": "header",
            "name": "Airlock-Reason",
            "required": False,
            "schema": {"type": "string", "maxLength": UNDO_REASON_MAX},
            "description": "Why you undo (a person's or the agent's own words; no secrets): "
            "kept on the undo, shown on the conflict it may open as the requester's reason and "
            "in the audit trail (`undo.requested` details `reason`). Longer than "
            f"{UNDO_REASON_MAX} characters: 400 `bad_header`.",
        },
    ],
    "responses": {
        "202": {
            "description": "Accepted: the action, with its undo's state in `undo`",
            "headers": {
                "Location": {"schema": {"type": "string"}},
                "Idempotent-Replayed": {
                    "schema": {"type": "string"},
                    "description": "`true` on a replay of the first answer",
                },
            },
        }
    },
}


def _undo_reason(request: HttpRequest) -> str:
    """Airlock-Reason on an undo, as on a write: optional, at most UNDO_REASON_MAX."""
    reason = request.headers.get("Airlock-Reason", "")
    if len(reason) > UNDO_REASON_MAX:
        raise ApiError(
            f"Airlock-Reason is longer than {UNDO_REASON_MAX} characters.",
            code="bad_header",
            extra={"header": "Airlock-Reason"},
        )
    return reason


@router.post(
    "/actions/{action_id}/undo",
    auth=run_or_person_token,
    response={202: ActionOut, **errors(400, 401, 403, 404, 409, 413, 422, 429)},
    summary="Undo an applied action inside its undo window",
    description="Checked in this order: authentication -> the action exists and is visible "
    "(404) -> permission (403) -> the run token's run is active (409 run_not_active) -> "
    "Idempotency-Key (400) -> idempotency (the same key and request replay the first "
    "answer, status and body, with `Idempotent-Replayed: true`; the same key for another "
    "action or body: 422 `idempotency_key_reused`; still in flight: 409) -> undo window "
    "(409, judged when the undo is accepted). Keys are scoped to the agent (run token) or "
    "to the person (personal token).",
    tags=["actions"],
    openapi_extra=_UNDO_DOC,
)
def action_undo(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    principal = principal_of(request)
    actor = principal.actor
    # The contract's precedence: 404 (what the caller cannot read, then the
    # service's), 403 and 409 run_not_active come before the Idempotency-Key.
    _visible(principal, action_id)
    action_undo_authorise(action_id=action_id, actor=actor)
    rate_limit_writes(principal)
    reason = _undo_reason(request)
    key = idempotency.key_check(request.headers.get("Idempotency-Key"))
    # Exactly like a write: the same key and request replay the first answer; the
    # same key for another action (another path) is 422 idempotency_key_reused.
    record_id = idempotency_claim(
        request,
        # A run token's key belongs to its agent, a personal token's to the person.
        actor=Actor.agent(principal.agent) if principal.kind == "run" else actor,
        key=key,
        method="POST",
        body=read_body(request),
    )
    if isinstance(record_id, HttpResponse):
        return record_id  # the replayed answer
    try:
        # The undo request and its stored answer commit together (or neither); its event
        # is appended last, so the audit head is locked for the commit only.
        with transaction.atomic(), audit_deferred():
            action_undo_request(
                action_id=action_id, actor=actor, idempotency_key=key, reason=reason
            )
            action = action_load(action_id)
            response = action_response(action, status=202)
            store_for_replay(record_id, response, action_id=action.pk)
    except BaseException:
        idempotency.idempotency_release(record_id=record_id)
        raise
    return response
