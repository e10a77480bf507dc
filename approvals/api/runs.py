"""API: runs — create, list, read (long-poll), heartbeat, finish, revoke."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from ninja import Query, Router

from approvals.api.longpoll import (
    hold,
    longpoll_read,
    parse_prefer_wait,
    release_connection,
)
from approvals.api.schemas import RevokeIn, RunCreatedOut, RunCreateIn, RunOut, RunPage
from approvals.api.serialize import run_json
from approvals.models import Run, RunStatus
from approvals.selectors import run_list_for_actor
from approvals.services import idempotency
from approvals.services import runs as run_services
from approvals.services.preconditions import TagCondition, read_condition
from approvals.services.tokens import Principal
from audit.services import Actor
from console.api_support import (
    JSON_CONTENT_TYPE,
    NEWEST_FIRST,
    TIME_CURSOR_PATTERN,
    RoleBearer,
    conditional_response,
    json_bytes,
    json_response,
    page_response,
    rate_limit_writes,
    writing_principal,
)
from console.auth import (
    agent_or_run_token,
    agent_token,
    any_token_or_ended_run,
    principal_of,
    reader_of,
)
from console.permissions import can_decide_approvals
from console.problems import errors
from engine.core.errors import DomainError, NotFound

router = Router(tags=["runs"])

RunStatusName = Literal["pending_approval", "active", "rejected", "finished", "expired", "revoked"]


def _run_for(principal: Principal, run_id: uuid.UUID) -> Run:
    """The run if the caller may read it (a run token: its own run), else 404."""
    run = run_list_for_actor(reader_of(principal)).filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"Run {run_id} not found.")
    return run


_RUN_KEY_HEADER = {
    "in": "header",
    "name": "Idempotency-Key",
    "required": False,
    "schema": {"type": "string", "pattern": idempotency.KEY_PATTERN.pattern},
    "description": "Optional; send one so that a retry after a lost answer never creates a "
    "second run. Scoped to the agent and kept at least 24 h, with the rules of writes: the "
    "same key and body replay the first `201` (the same run and token, "
    "`Idempotent-Replayed: true`); the same key with another body is `422 "
    "idempotency_key_reused`; while the first request is processed, `409 "
    "idempotency_key_in_flight` (retryable, `Retry-After`). Refusals (`409 "
    "write_set_conflict`, `422`, …) are not kept: the key is free again.",
}
# The header under which a stored answer keeps its run token sealed (never sent).
_SEALED_TOKEN = "Airlock-Sealed-Token"


@router.post(
    "/runs",
    auth=agent_token,
    response={201: RunCreatedOut, **errors(400, 401, 403, 409, 413, 422, 429)},
    summary="Create a run with a declared write set",
    openapi_extra={
        "parameters": [_RUN_KEY_HEADER],
        "responses": {
            "201": {
                "description": "Created (or, with an Idempotency-Key used before, replayed)",
                "headers": {
                    "Location": {"schema": {"type": "string"}},
                    "Idempotent-Replayed": {"schema": {"type": "string"}},
                },
            }
        },
    },
)
def run_create(request: HttpRequest, payload: RunCreateIn) -> HttpResponse:
    """Checked in order: authentication -> write rate -> body (422, before the handler)
    -> Idempotency-Key format -> idempotency (a replay, or 409 in flight, or 422 reused)
    -> the run, whose 201 is kept under the key in the transaction that creates it."""
    principal = writing_principal(request)
    agent = principal.agent
    assert agent is not None
    key = idempotency.optional_key_check(request.headers.get("Idempotency-Key"))

    def create(on_created: Callable[[Run, str], None] | None) -> tuple[Run, str]:
        return run_services.run_create(
            agent=agent,
            task=payload.task,
            write_set=[entry.model_dump() for entry in payload.write_set],
            ttl_seconds=payload.ttl_seconds,
            actor=principal.actor,
            token_minted_by_id=principal.token_minted_by_id,
            on_created=on_created,
        )

    if key is None:
        return _run_created(*create(None))
    begin = idempotency.idempotency_begin(
        actor=Actor.agent(agent),  # the agent's keys, shared with its runs' writes
        key=key,
        method="POST",
        path=request.path,
        fingerprint=idempotency.request_fingerprint(
            method="POST", path=request.path, body=request.body
        ),
    )
    if begin.replay is not None:
        return _run_replayed(begin.replay)
    record_id = begin.record_id
    assert record_id is not None

    def keep(run: Run, token: str) -> None:
        idempotency.idempotency_complete(record_id=record_id, response=_stored_answer(run, token))

    try:
        run, token = create(keep)
    except BaseException:
        idempotency.idempotency_release(record_id=record_id)
        raise
    return _run_created(run, token)


def _run_created(run: Run, token: str) -> HttpResponse:
    body = run_json(run) | {"token": token}
    return json_response(body, status=201, headers={"Location": body["url"]})


def _stored_answer(run: Run, token: str) -> idempotency.StoredResponse:
    """The 201 to replay, its token sealed apart (never stored readable)."""
    body = run_json(run)
    headers = {
        "Content-Type": JSON_CONTENT_TYPE,
        "Location": body["url"],
        _SEALED_TOKEN: idempotency.secret_seal(token),
    }
    return idempotency.StoredResponse(status=201, headers=headers, body=json_bytes(body))


def _run_replayed(stored: idempotency.StoredResponse) -> HttpResponse:
    """The first 201 again: the same run, the same token (unsealed), the same bytes."""
    headers = dict(stored.headers)
    token = idempotency.secret_unseal(headers.pop(_SEALED_TOKEN, ""))
    body = json.loads(stored.body)
    if token is None:
        raise DomainError(
            f"Run {body.get('id')} was created with this Idempotency-Key, but its token can "
            "no longer be returned (the server's SECRET_KEY changed since). Start a new run "
            "with a new key; an operator may revoke the first.",
            code="conflict",
        )
    response = HttpResponse(json_bytes(body | {"token": token}), status=stored.status)
    for name, value in headers.items():
        response[name] = value
    response["Idempotent-Replayed"] = "true"
    return response


@router.get(
    "/runs",
    auth=any_token_or_ended_run,
    response={200: RunPage, **errors(400, 401, 422)},
    summary="List runs visible to the caller",
)
def run_list(
    request: HttpRequest,
    status: RunStatusName | None = None,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=TIME_CURSOR_PATTERN),
) -> HttpResponse:
    runs = run_list_for_actor(reader_of(principal_of(request)))
    if status:
        runs = runs.filter(status=status)
    return page_response(runs, keyset=NEWEST_FIRST, cursor=cursor, limit=limit, render=run_json)


@dataclass(frozen=True)
class RunState:
    etag: str
    status: str
    body: bytes
    # An active run turns `expired` at this moment without any publish: a waiter
    # re-reads then instead of sleeping through it.
    expires_at: datetime | None


def _run_state(principal: Principal, run_id: uuid.UUID, close: bool) -> RunState:
    """Read the run. Its ETag is a digest of its representation, so it changes with
    its status (and with anything else the body shows, such as a heartbeat's expiry)."""
    try:
        return run_state_of(_run_for(principal, run_id))
    finally:
        release_connection(close)


def run_state_of(run: Run) -> RunState:
    """The run's answer (body, ETag) and status: run_get's, and the read front's
    (approvals/api/fastpoll.py) for the run it read in one statement."""
    body = json_bytes(run_json(run))
    status = run_services.run_effective_status(run)
    return RunState(
        etag=f'"r{hashlib.sha256(body).hexdigest()[:24]}"',
        status=status,
        body=body,
        expires_at=run.expires_at if status == RunStatus.ACTIVE else None,
    )


def _run_should_hold(state: RunState, condition: TagCondition | None) -> bool:
    if condition is not None:
        return condition.weak_match(state.etag)
    # Without If-None-Match a run is held while it waits for a person's decision.
    return state.status == RunStatus.PENDING_APPROVAL


_RUN_HOLDS = (
    "(with If-None-Match: while its ETag still matches; without: while it is `pending_approval`)"
)


@longpoll_read(
    router,
    "/runs/{run_id}",
    out=RunOut,
    subject="run",
    holds=_RUN_HOLDS,
    auth=any_token_or_ended_run,
    summary="Read a run (long-poll with Prefer: wait=N)",
    description="A run token reads its own run, also after the run ended (`status` and "
    "`status_reason` say why). The `ETag` changes with the run's status; an agent waits for "
    "its run's approval with `Prefer: wait=N` and `If-None-Match`, as for actions.",
)
async def run_get(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    principal = principal_of(request)
    wait = parse_prefer_wait(request.headers.get("Prefer"))
    condition = read_condition(request.headers.get("If-None-Match"))
    read = sync_to_async(_run_state)
    if not wait:
        state = await read(principal, run_id, False)
    else:
        state = await hold(
            channel=run_id,
            run=True,
            wait=wait,
            read=lambda woken: read(principal, run_id, True),
            should_hold=lambda state: _run_should_hold(state, condition),
            changes_by_itself_at=lambda state: state.expires_at,
        )
    return conditional_response(etag=state.etag, body=state.body, condition=condition, wait=wait)


@router.post(
    "/runs/{run_id}/heartbeat",
    auth=agent_or_run_token,
    response={200: RunOut, **errors(401, 403, 404, 409, 422, 429)},
    summary="Extend the run's expiry (never past its approved maximum)",
)
def run_heartbeat(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    return _change_own_run(request, run_id, run_services.run_heartbeat)


@router.post(
    "/runs/{run_id}/finish",
    auth=agent_or_run_token,
    response={200: RunOut, **errors(401, 403, 404, 409, 422, 429)},
    summary="End the run and free its ownership records",
)
def run_finish(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    return _change_own_run(request, run_id, run_services.run_finish)


def _change_own_run(
    request: HttpRequest, run_id: uuid.UUID, change: Callable[..., Run]
) -> HttpResponse:
    """Heartbeat or finish: the agent's or the run's own token, on a run it may read."""
    principal = principal_of(request)
    run = _run_for(principal, run_id)
    rate_limit_writes(principal)
    return json_response(run_json(change(run=run, actor=principal.actor)))


@router.post(
    "/runs/{run_id}/revoke",
    # The role is decided before the body is validated (no schema leak).
    auth=RoleBearer(can_decide_approvals, "Revoking a run needs the operator role."),
    response={200: RunOut, **errors(400, 401, 403, 404, 409, 413, 422, 429)},
    summary="Revoke a run (operators): ownership freed, unexecuted actions cancelled",
)
def run_revoke(request: HttpRequest, run_id: uuid.UUID, payload: RevokeIn) -> HttpResponse:
    principal = principal_of(request)
    run = Run.objects.select_related("agent").filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"Run {run_id} not found.")
    rate_limit_writes(principal)
    run = run_services.run_revoke(run=run, actor=principal.actor, reason=payload.reason)
    return json_response(run_json(run))
