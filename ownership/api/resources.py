"""API: resources — read, list, and the conditional writes (PUT / PATCH / DELETE)
that become actions."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import Query, Router

from approvals.api.schemas import ActionOut
from approvals.api.serialize import action_load, action_response
from approvals.models import Action
from approvals.services import actions as action_services
from approvals.services import idempotency, preconditions
from approvals.services.preconditions import TagCondition
from approvals.services.queued_writes import queued_write_over
from audit.services import Actor
from console.api_support import (
    PAGE_LIMIT_DEFAULT,
    PAGE_LIMIT_MAX,
    RESOURCE_CURSOR_PATTERN,
    Keyset,
    conditional_response,
    idempotency_claim,
    json_bytes,
    page_response,
    parse_json_object,
    propose_for_replay,
    rate_limit_writes,
    read_body,
)
from console.auth import any_token, principal_of, run_token
from console.compiled_query import CompiledQuery, Param
from console.problems import ApiError, errors
from engine.core.errors import NotFound
from ownership.api.schemas import (
    KIND_PATTERN,
    PREFIX_PATTERN,
    STRONG_ETAG_PATTERN,
    KindPath,
    NamePath,
    ResourceOut,
    ResourcePage,
)
from ownership.api.serialize import resource_json
from ownership.models import Resource, ResourceKind
from ownership.selectors import resource_live, resources_listed
from ownership.targets import is_external, read_through, refresh_mirror

router = Router(tags=["resources"])

# On a read: the approved write already queued to replace the version read (its id).
QUEUED_ACTION_HEADER = "Airlock-Queued-Action"

# By kind, then name; the cursor is the last `kind/name` (RESOURCE_CURSOR_PATTERN). The
# list's order in Django and in the read front (approvals/api/fastpoll_routes.py).
BY_KIND_AND_NAME = Keyset(
    ("kind_id", "name"),
    False,
    lambda values: f"{values[0]}/{values[1]}",
    lambda raw: list(raw.partition("/")[::2]),
)

_READ_HEADERS = [
    {
        "in": "header",
        "name": "If-None-Match",
        "required": False,
        "schema": {"type": "string"},
        "description": "ETags you hold: 304 when one is still current (weak comparison). "
        "A malformed value is ignored.",
    }
]


# A read's statements, compiled once (console/compiled_query.py): the ORM building them at
# each request was most of this view's own CPU (cProfile of the Django path, 300 reads).
_KIND_TARGET = CompiledQuery(
    lambda: ResourceKind.objects.filter(
        slug=Param("kind", ResourceKind._meta.get_field("slug"))
    ).only("slug", "target")
)


def _live_resource() -> Any:
    # The selector takes the Params where it takes values (typed str for its other callers).
    kind: Any = Param("kind", ResourceKind._meta.get_field("slug"))
    name: Any = Param("name", Resource._meta.get_field("name"))
    return resource_live(kind=kind, name=name)


_LIVE_RESOURCE = CompiledQuery(_live_resource)


@router.get(
    "/resources/{kind}/{name}",
    auth=any_token,
    response={200: ResourceOut, 304: None, **errors(400, 401, 403, 404, 422)},
    summary="Read a resource (strong ETag)",
    openapi_extra={
        "parameters": _READ_HEADERS,
        "responses": {
            "200": {
                "description": "The resource",
                "headers": {
                    "ETag": {"schema": {"type": "string"}},
                    QUEUED_ACTION_HEADER: {
                        "schema": {"type": "string", "format": "uuid"},
                        "description": "Present when an approved write is already queued "
                        "to replace this version: a write based on it would be refused "
                        "(412 with `queued_action`). Wait for that action (GET "
                        "/api/v1/actions/{id} with `Prefer: wait=N`; readable when it is your "
                        "agent's own), then re-read.",
                    },
                },
            },
            "304": {"description": "Not modified (with the same Airlock-Queued-Action)"},
        },
    },
)
def resource_get(request: HttpRequest, kind: str = KindPath, name: str = NamePath) -> HttpResponse:
    resource_kind = _KIND_TARGET.first(kind=kind)
    if resource_kind is not None and is_external(resource_kind):
        # A kind whose documents live elsewhere is read from its target: the ETag is the
        # target's own token, and the mirror keeps what was shown (for approvals, conflicts).
        resource_kind = ResourceKind.objects.get(slug=kind)
        mirrored = read_through(resource_kind, name)
        resource = mirrored if mirrored is not None and not mirrored.deleted else None
    else:
        resource = _LIVE_RESOURCE.first(kind=kind, name=name)  # (kind, name) is unique
    if resource is None:
        raise NotFound(f"{kind}/{name} does not exist.")
    response = conditional_response(
        etag=resource.etag,
        body=json_bytes(resource_json(resource)),
        condition=preconditions.read_condition(request.headers.get("If-None-Match")),
        wait=None,
    )
    queued = queued_write_over(kind, name, resource.token)
    if queued is not None:
        response[QUEUED_ACTION_HEADER] = str(queued)
    return response


@router.get(
    "/resources",
    auth=any_token,
    response={200: ResourcePage, **errors(400, 401, 422)},
    summary="List resources by kind and name prefix",
)
def resource_list(
    request: HttpRequest,
    kind: str | None = Query(None, pattern=KIND_PATTERN),
    prefix: str | None = Query(None, pattern=PREFIX_PATTERN),
    limit: int = Query(PAGE_LIMIT_DEFAULT, ge=1, le=PAGE_LIMIT_MAX),
    cursor: str | None = Query(None, pattern=RESOURCE_CURSOR_PATTERN),
) -> HttpResponse:
    """Also answered in front of Django (approvals/api/fastpoll_routes.py `ListRoute`) for run
    and agent tokens, with this view's parameters, selector, order and serializer."""
    return page_response(
        resources_listed(kind=kind, prefix=prefix),
        keyset=BY_KIND_AND_NAME,
        cursor=cursor,
        limit=limit,
        render=resource_json,
    )


# --- Conditional writes -------------------------------------------------------------

_WRITE_HEADERS = [
    {
        "in": "header",
        "name": "Idempotency-Key",
        "required": True,
        "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._:-]{8,255}$"},
        "description": "Scoped to the agent, kept at least 24 h. A retry with the same key "
        "and request replays the original answer (`Idempotent-Replayed: true`).",
    },
    {
        "in": "header",
        "name": "If-Match",
        "required": False,
        "schema": {"type": "string", "pattern": STRONG_ETAG_PATTERN},
        "description": 'Exactly one strong ETag, the version you read, e.g. `"41"`. Required '
        "to update or delete. `*` is refused with `428 precondition_required`; a list of "
        "tags or a weak tag (`W/…`) with `400 if_match_invalid`. Either refusal changes "
        "nothing and stores nothing under the Idempotency-Key.",
    },
    {
        "in": "header",
        "name": "Airlock-Reason",
        "required": False,
        "schema": {"type": "string", "maxLength": 500},
        "description": "Why, shown to approvers and kept in the audit trail (no secrets).",
    },
]
_CREATE_HEADER = {
    "in": "header",
    "name": "If-None-Match",
    "required": False,
    "schema": {"type": "string", "pattern": r"^[ \t]*\*[ \t]*$"},
    "description": "`*` to create (the name must be free).",
}
_WRITE_RESPONSES = {
    "202": {
        "description": "Accepted: the action, executed on a worker after any approval",
        "headers": {
            "Location": {"schema": {"type": "string"}, "description": "/api/v1/actions/{id}"},
            "Idempotent-Replayed": {"schema": {"type": "string"}},
        },
    },
    "412": {
        "description": "stale_version: If-Match (or If-None-Match: *) no longer holds. Members "
        "`resource`, `expected_etag`, `current_etag`, `conflict_class`, `resolver`, "
        "`retryable_by_agent`; `retryable: false`. When the tag still matches but an approved "
        "write already queued on the resource will replace that version (or, for a create, "
        "another create of the name is queued), the body also names it: `queued_action` "
        "`{id, url}`. Wait for that action (GET its url with `Prefer: wait=N`; readable when "
        "it is your agent's own), then re-read."
    },
}
_WRITE_ERRORS = errors(400, 401, 403, 404, 409, 412, 413, 415, 422, 423, 428, 429)


def _object_body(media: str) -> dict[str, Any]:
    return {
        "required": True,
        "content": {media: {"schema": {"type": "object", "additionalProperties": True}}},
    }


@dataclass(frozen=True)
class _Preconditions:
    if_match: Any
    if_none_match: TagCondition | None
    reason: str


def _preconditions(request: HttpRequest, method: str) -> _Preconditions:
    """If-Match (one strong tag: `*` -> 428, a list or W/ -> 400 if_match_invalid),
    If-None-Match (only `*` with PUT), Airlock-Reason (at most 500 characters)."""
    if_match = preconditions.parse_write_if_match(request.headers.get("If-Match"))
    if_none_match = preconditions.parse_tag_condition(
        request.headers.get("If-None-Match"), header="If-None-Match"
    )
    if if_none_match is not None and not (method == "PUT" and if_none_match.any):
        raise ApiError(
            "On writes, If-None-Match is only allowed as '*' with PUT (create).",
            code="bad_header",
            extra={"header": "If-None-Match"},
        )
    if if_none_match is not None and if_match is not None:
        raise ApiError(
            "Send either If-Match (update) or If-None-Match: * (create), not both.",
            code="bad_header",
            extra={"header": "If-Match"},
        )
    reason = request.headers.get("Airlock-Reason", "")
    if len(reason) > 500:
        raise ApiError(
            "Airlock-Reason is longer than 500 characters.",
            code="bad_header",
            extra={"header": "Airlock-Reason"},
        )
    return _Preconditions(if_match=if_match, if_none_match=if_none_match, reason=reason)


def _payload(request: HttpRequest, method: str, body: bytes) -> dict[str, Any] | None:
    """PUT: a JSON document; PATCH: a JSON merge patch; DELETE: no body."""
    content_type = request.headers.get("Content-Type", "")
    if method == "PUT":
        return parse_json_object(body, content_type=content_type, field="document")
    if method == "PATCH":
        return parse_json_object(
            body,
            content_type=content_type,
            allowed_types=("application/merge-patch+json", "application/json"),
            field="patch",
        )
    if body:
        raise ApiError(
            "DELETE takes no body.",
            code="validation_error",
            status=422,
            extra={"errors": [{"field": "body", "message": "must be empty"}]},
        )
    return None


def _write(request: HttpRequest, kind: str, name: str, method: str) -> HttpResponse:
    """Checked in the contract's order: authentication (done) -> run active -> write
    set -> Idempotency-Key format -> header and body syntax (never stored) ->
    idempotency -> the proposal, whose answer (202, or a refused stale write) is
    stored for replay in the same transaction."""
    principal = principal_of(request)
    run = principal.run
    assert run is not None and principal.agent is not None
    rate_limit_writes(principal)
    raw_if_none_match = request.headers.get("If-None-Match")
    operation = action_services.write_operation(
        method, create=raw_if_none_match is not None and raw_if_none_match.strip() == "*"
    )
    resource_kind = action_services.action_check_writable(
        run=run, kind=kind, name=name, operation=operation
    )
    key = idempotency.key_check(request.headers.get("Idempotency-Key"))
    preconditions = _preconditions(request, method)
    if is_external(resource_kind):
        _refresh_mirror(resource_kind, name, preconditions.if_match)
    body = read_body(request)
    proposal = action_services.Proposal(
        kind=resource_kind,
        name=name,
        operation=operation,
        payload_format=action_services.PAYLOAD_FORMATS[method],
        payload=_payload(request, method, body),
        if_match=preconditions.if_match,
        create_if_absent=preconditions.if_none_match is not None,
        idempotency_key=key,
        reason=preconditions.reason,
    )
    record_id = idempotency_claim(
        request,
        actor=Actor.agent(principal.agent),  # keys belong to the agent, not the run
        key=key,
        method=method,
        body=body,
    )
    if isinstance(record_id, HttpResponse):
        return record_id  # the replayed answer
    return _propose(run, proposal, record_id)


def _refresh_mirror(kind: ResourceKind, name: str, if_match: Any) -> None:
    """The mirror holds the version the agent names (ownership.targets.refresh_mirror)."""
    refresh_mirror(kind, name, None if if_match is None else str(if_match.tags[0]))


def _propose(run: Any, proposal: action_services.Proposal, record_id: int) -> HttpResponse:
    def render(action: Action) -> tuple[HttpResponse, Any]:
        return action_response(action_load(action.pk), status=202), action.pk

    return propose_for_replay(
        record_id,
        lambda on_recorded, on_refused: action_services.action_propose(
            run=run, proposal=proposal, on_recorded=on_recorded, on_refused=on_refused
        ),
        render,
    )


@router.put(
    "/resources/{kind}/{name}",
    auth=run_token,
    response={202: ActionOut, **_WRITE_ERRORS},
    summary="Replace a resource's document (If-Match) or create it (If-None-Match: *)",
    openapi_extra={
        "parameters": [*_WRITE_HEADERS, _CREATE_HEADER],
        "requestBody": _object_body("application/json"),
        "responses": _WRITE_RESPONSES,
    },
)
def resource_put(request: HttpRequest, kind: str = KindPath, name: str = NamePath) -> HttpResponse:
    return _write(request, kind, name, "PUT")


@router.patch(
    "/resources/{kind}/{name}",
    auth=run_token,
    response={202: ActionOut, **_WRITE_ERRORS},
    summary="Change a resource with a JSON merge patch (RFC 7396)",
    openapi_extra={
        "parameters": _WRITE_HEADERS,
        "requestBody": _object_body("application/merge-patch+json"),
        "responses": _WRITE_RESPONSES,
    },
)
def resource_patch(
    request: HttpRequest, kind: str = KindPath, name: str = NamePath
) -> HttpResponse:
    return _write(request, kind, name, "PATCH")


@router.delete(
    "/resources/{kind}/{name}",
    auth=run_token,
    response={202: ActionOut, **_WRITE_ERRORS},
    summary="Delete a resource (If-Match)",
    openapi_extra={"parameters": _WRITE_HEADERS, "responses": _WRITE_RESPONSES},
)
def resource_delete(
    request: HttpRequest, kind: str = KindPath, name: str = NamePath
) -> HttpResponse:
    return _write(request, kind, name, "DELETE")
