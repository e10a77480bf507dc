"""API: resources (read, list, conditional writes), conflicts, conflict classes,
resource kinds."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from ninja import Field, Path, Query, Router, Schema
from pydantic import BeforeValidator, ConfigDict

from approvals.api import ActionOut, action_body, errors
from approvals.models import Action
from approvals.services import actions as action_services
from approvals.services import idempotency
from audit.services import Actor
from console.api_support import (
    RESOURCE_CURSOR_PATTERN,
    TEXT_PATTERN,
    TIME_CURSOR_PATTERN,
    JsonInt,
    RoleBearer,
    iso,
    json_response,
    parse_json_object,
    rate_limit_writes,
    read_body,
    replay_response,
    time_page,
)
from console.auth import any_token, person_token, principal_of, run_token
from console.core.errors import DomainError, NotFound
from console.permissions import is_admin
from console.problems import ApiError, problem_from_error
from ownership.models import Conflict, ConflictClass, Resource, ResourceKind
from ownership.services import catalog

router = Router()

# Admin endpoints decide 401/403 before the body is validated (no schema leak).
class_admin_token = RoleBearer(is_admin, "Only admins edit the conflict-class table.")
kind_admin_token = RoleBearer(is_admin, "Only admins edit resource kinds.")

KIND_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+=,-]{0,254}$"
PREFIX_PATTERN = r"^[A-Za-z0-9._:@+=,-]{0,255}$"
# If-Match on a write: one strong entity tag (RFC 9110 allows more; the contract does not).
STRONG_ETAG_PATTERN = r'^[ \t]*"[!#-~]*"[ \t]*$'
KindPath = Path(..., pattern=KIND_PATTERN)
NamePath = Path(..., pattern=NAME_PATTERN)


# --- Schemas -------------------------------------------------------------------


class ResourceOut(Schema):
    kind: str
    name: str
    version: int
    etag: str
    document: dict[str, Any]
    owner_group: str
    updated_at: datetime


class ResourcePage(Schema):
    items: list[ResourceOut]
    next: str | None


class ConflictClassOut(Schema):
    slug: str
    name: str
    description: str
    approval_mode: Literal["per_run", "per_call"]
    on_conflict: str
    resolver: str
    retryable_by_agent: bool
    quorum: int
    undo_window_seconds: int
    approval_ttl_seconds: int
    escalation_seconds: int
    escalation_group: str
    forbid_agent_owner_approval: bool
    updated_at: datetime


class ConflictClassList(Schema):
    items: list[ConflictClassOut]


_RFC3339 = re.compile(
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)


def _timestamp(value: Any) -> Any:
    """A read-only `updated_at` sent back as GET returned it: an RFC 3339 date-time."""
    if not isinstance(value, str) or not _RFC3339.match(value):
        raise ValueError("must be an RFC 3339 date-time string")
    # fromisoformat knows no lowercase separators and no leap second.
    normal = value.upper().replace(":60", ":59", 1) if value[17:19] == "60" else value.upper()
    try:
        datetime.fromisoformat(normal)
    except ValueError as exc:
        raise ValueError("must be an RFC 3339 date-time string") from exc
    return value


ReadOnlyTimestamp = Annotated[str, BeforeValidator(_timestamp)]
_READ_ONLY = "Read-only, accepted so that GET -> edit -> PUT works: "


class ConflictClassIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    slug: str | None = Field(
        None, pattern=KIND_PATTERN, description=_READ_ONLY + "must equal the path's slug."
    )
    retryable_by_agent: bool | None = Field(
        None,
        description=_READ_ONLY + "derived (`resolver` is `agent`); 422 when it contradicts.",
    )
    updated_at: ReadOnlyTimestamp | None = Field(
        None,
        description=_READ_ONLY + "stamped by the server; any date-time is ignored.",
        json_schema_extra={"format": "date-time"},
    )

    name: str = Field(..., min_length=1, max_length=200, pattern=TEXT_PATTERN)
    description: str = Field("", max_length=5000, pattern=TEXT_PATTERN)
    approval_mode: Literal["per_run", "per_call"]
    on_conflict: Literal[
        "retry", "recompute", "present_candidates", "request_review", "stop_unless_lease"
    ]
    resolver: str = Field(..., pattern=r"^(agent|owner|group:[A-Za-z0-9._-]{1,140})$")
    quorum: JsonInt = Field(1, ge=1, le=20)
    undo_window_seconds: JsonInt = Field(600, ge=0, le=2_592_000)
    approval_ttl_seconds: JsonInt = Field(172_800, ge=60, le=2_592_000)
    escalation_seconds: JsonInt = Field(0, ge=0, le=2_592_000)
    escalation_group: str = Field("", pattern=r"^[A-Za-z0-9._-]{0,150}$")
    forbid_agent_owner_approval: bool = True


class KindClasses(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    create: str = Field(..., pattern=KIND_PATTERN)
    update: str = Field(..., pattern=KIND_PATTERN)
    delete: str = Field(..., pattern=KIND_PATTERN)


class ResourceKindIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    kind: str | None = Field(
        None, pattern=KIND_PATTERN, description=_READ_ONLY + "must equal the path's kind."
    )
    updated_at: ReadOnlyTimestamp | None = Field(
        None,
        description=_READ_ONLY + "stamped by the server; any date-time is ignored.",
        json_schema_extra={"format": "date-time"},
    )

    classes: KindClasses
    owner_group: str = Field(..., pattern=r"^[A-Za-z0-9._-]{1,150}$")
    undo_window_seconds: JsonInt | None = Field(None, ge=0, le=2_592_000)
    description: str = Field("", max_length=5000, pattern=TEXT_PATTERN)
    target: Literal["managed", "http"] = "managed"
    target_url: str = Field("", max_length=200, pattern=TEXT_PATTERN)


class ResourceKindOut(Schema):
    kind: str
    description: str
    classes: dict[str, str]
    owner_group: str
    undo_window_seconds: int | None
    target: str
    target_url: str
    updated_at: datetime


class ResourceKindList(Schema):
    items: list[ResourceKindOut]


class FieldDiff(Schema):
    model_config = ConfigDict(extra="allow")

    path: str
    base: Any = None
    current: Any = None
    proposed: Any = None
    change: Literal["agent_only", "other_only", "both"]


class DocumentAt(Schema):
    etag: str | None
    document: Any = None


class ProposedDocument(Schema):
    document: Any = None


class ConflictOut(Schema):
    id: uuid.UUID
    action: uuid.UUID
    resource: str
    conflict_class: str
    resolver: str
    resolver_group: str
    origin: Literal["write", "undo"]
    status: Literal["open", "resolved"]
    base: DocumentAt
    current: DocumentAt
    proposed: ProposedDocument
    fields: list[FieldDiff]
    resolution: dict[str, Any] | None
    created_at: datetime


class ConflictPage(Schema):
    items: list[ConflictOut]
    next: str | None


class ResolutionIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    choice: Literal["keep_current", "take_proposed", "merge"]
    # Keys are JSON pointers of the conflict's fields (checked by the service).
    fields: dict[str, Literal["current", "proposed"]] = Field(default_factory=dict)
    comment: str = Field("", max_length=2000, pattern=TEXT_PATTERN)


# --- Resources: reads ----------------------------------------------------------------


def resource_json(resource: Resource) -> dict[str, Any]:
    return {
        "kind": resource.kind_id,
        "name": resource.name,
        "version": resource.version,
        "etag": resource.etag,
        "document": resource.document,
        "owner_group": resource.owner_group,
        "updated_at": iso(resource.updated_at),
    }


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


@router.get(
    "/resources/{kind}/{name}",
    auth=any_token,
    response={200: ResourceOut, 304: None, **errors(400, 401, 403, 404, 422)},
    summary="Read a resource (strong ETag)",
    tags=["resources"],
    openapi_extra={
        "parameters": _READ_HEADERS,
        "responses": {
            "200": {
                "description": "The resource",
                "headers": {"ETag": {"schema": {"type": "string"}}},
            },
            "304": {"description": "Not modified"},
        },
    },
)
def resource_get(request: HttpRequest, kind: str = KindPath, name: str = NamePath) -> HttpResponse:
    resource = Resource.objects.filter(kind_id=kind, name=name, deleted=False).first()
    if resource is None:
        raise NotFound(f"{kind}/{name} does not exist.")
    condition = action_services.read_condition(request.headers.get("If-None-Match"))
    headers = {"ETag": resource.etag, "Cache-Control": "no-cache"}
    if condition is not None and condition.weak_match(resource.etag):
        response = HttpResponse(status=304)
        for key, value in headers.items():
            response[key] = value
        return response
    return json_response(resource_json(resource), headers=headers)


@router.get(
    "/resources",
    auth=any_token,
    response={200: ResourcePage, **errors(400, 401, 422)},
    summary="List resources by kind and name prefix",
    tags=["resources"],
)
def resource_list(
    request: HttpRequest,
    kind: str | None = Query(None, pattern=KIND_PATTERN),
    prefix: str | None = Query(None, pattern=PREFIX_PATTERN),
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=RESOURCE_CURSOR_PATTERN),
) -> HttpResponse:
    resources = Resource.objects.filter(deleted=False)
    if kind:
        resources = resources.filter(kind_id=kind)
    if prefix:
        resources = resources.filter(name__startswith=prefix)
    if cursor:
        after_kind, _, after_name = cursor.partition("/")
        resources = resources.filter(
            Q(kind_id__gt=after_kind) | Q(kind_id=after_kind, name__gt=after_name)
        )
    page = list(resources.order_by("kind_id", "name")[: limit + 1])
    next_cursor = None
    if len(page) > limit:
        page = page[:limit]
        next_cursor = f"{page[-1].kind_id}/{page[-1].name}"
    return json_response({"items": [resource_json(r) for r in page], "next": next_cursor})


# --- Resources: conditional writes -------------------------------------------------

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
    }
}
_WRITE_ERRORS = errors(400, 401, 403, 404, 409, 412, 413, 415, 422, 423, 428, 429)


def _object_body(media: str) -> dict[str, Any]:
    return {
        "required": True,
        "content": {media: {"schema": {"type": "object", "additionalProperties": True}}},
    }


def _write(request: HttpRequest, kind: str, name: str, method: str) -> HttpResponse:
    principal = principal_of(request)
    run = principal.run
    assert run is not None
    rate_limit_writes(principal)
    raw_if_match = request.headers.get("If-Match")
    raw_if_none_match = request.headers.get("If-None-Match")
    if method == "DELETE":
        operation = "delete"
    elif method == "PUT" and raw_if_none_match is not None and raw_if_none_match.strip() == "*":
        operation = "create"
    else:
        operation = "update"
    # authentication (done) -> run active -> write set
    resource_kind = action_services.action_check_writable(
        run=run, kind=kind, name=name, operation=operation
    )
    # -> key format
    key = idempotency.key_check(request.headers.get("Idempotency-Key"))
    # Header and body syntax: requests that are not well-formed never reach the
    # idempotency layer (and are not stored).
    # One strong tag, the version read: `*` -> 428, a list or W/ -> 400 if_match_invalid.
    if_match = action_services.parse_write_if_match(raw_if_match)
    if_none_match = action_services.parse_tag_condition(raw_if_none_match, header="If-None-Match")
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
    body = read_body(request)
    payload: dict[str, Any] | None = None
    content_type = request.headers.get("Content-Type", "")
    if method == "PUT":
        payload = parse_json_object(body, content_type=content_type, field="document")
    elif method == "PATCH":
        payload = parse_json_object(
            body,
            content_type=content_type,
            allowed_types=("application/merge-patch+json", "application/json"),
            field="patch",
        )
    elif body:
        raise ApiError(
            "DELETE takes no body.",
            code="validation_error",
            status=422,
            extra={"errors": [{"field": "body", "message": "must be empty"}]},
        )
    # -> idempotency
    fingerprint = idempotency.request_fingerprint(method=method, path=request.path, body=body)
    assert principal.agent is not None
    begin = idempotency.idempotency_begin(
        agent=principal.agent, key=key, method=method, path=request.path, fingerprint=fingerprint
    )
    if begin.replay is not None:
        return replay_response(begin.replay)
    assert begin.record_id is not None
    record_id = begin.record_id
    produced: dict[str, HttpResponse] = {}

    def on_recorded(action: Action) -> None:
        action = Action.objects.select_related("kind", "conflict_class", "run__agent").get(
            pk=action.pk
        )
        response = HttpResponse(action_body(action), status=202, content_type="application/json")
        response["Location"] = f"/api/v1/actions/{action.pk}"
        response["ETag"] = action.etag
        stored = idempotency.StoredResponse(
            status=202,
            headers={
                "Content-Type": response["Content-Type"],
                "Location": response["Location"],
                "ETag": response["ETag"],
            },
            body=response.content,
        )
        idempotency.idempotency_complete(record_id=record_id, response=stored, action_id=action.pk)
        produced["response"] = response

    def on_refused(error: DomainError) -> None:
        response = problem_from_error(error)
        stored = idempotency.StoredResponse(
            status=response.status_code,
            headers={"Content-Type": response["Content-Type"]},
            body=response.content,
        )
        idempotency.idempotency_complete(record_id=record_id, response=stored)
        produced["response"] = response

    proposal = action_services.Proposal(
        kind=resource_kind,
        name=name,
        operation=operation,
        payload_format=action_services.PAYLOAD_FORMATS[method],
        payload=payload,
        if_match=if_match,
        create_if_absent=if_none_match is not None,
        idempotency_key=key,
        reason=reason,
    )
    try:
        action_services.action_propose(
            run=run, proposal=proposal, on_recorded=on_recorded, on_refused=on_refused
        )
    except DomainError as error:
        if "response" in produced:  # the refused stale write, stored for replay
            return produced["response"]
        idempotency.idempotency_release(record_id=record_id)
        raise error from None
    except BaseException:
        idempotency.idempotency_release(record_id=record_id)
        raise
    return produced["response"]


@router.put(
    "/resources/{kind}/{name}",
    auth=run_token,
    response={202: ActionOut, **_WRITE_ERRORS},
    summary="Replace a resource's document (If-Match) or create it (If-None-Match: *)",
    tags=["resources"],
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
    tags=["resources"],
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
    tags=["resources"],
    openapi_extra={"parameters": _WRITE_HEADERS, "responses": _WRITE_RESPONSES},
)
def resource_delete(
    request: HttpRequest, kind: str = KindPath, name: str = NamePath
) -> HttpResponse:
    return _write(request, kind, name, "DELETE")


# --- Conflicts ---------------------------------------------------------------


def conflict_json(conflict: Conflict) -> dict[str, Any]:
    resolution = None
    if conflict.resolution:
        resolution = {
            "choice": conflict.resolution,
            "fields": conflict.resolution_fields or {},
            "comment": conflict.resolution_comment,
            "by": conflict.resolved_by.get_username() if conflict.resolved_by else None,
            "at": iso(conflict.resolved_at),
            "action": str(conflict.resolution_action_id) if conflict.resolution_action_id else None,
        }
    elif conflict.status == "resolved":
        resolution = {
            "choice": None,
            "fields": {},
            "comment": conflict.resolution_comment,
            "by": conflict.resolved_by.get_username() if conflict.resolved_by else None,
            "at": iso(conflict.resolved_at),
            "action": None,
        }
    return {
        "id": str(conflict.pk),
        "action": str(conflict.action_id),
        "resource": conflict.resource.identifier,
        "conflict_class": conflict.conflict_class_id,
        "resolver": conflict.resolver,
        "resolver_group": conflict.resolver_group,
        "origin": conflict.origin,
        "status": conflict.status,
        "base": {"etag": f'"{conflict.base_version}"', "document": conflict.base_document},
        "current": {"etag": f'"{conflict.current_version}"', "document": conflict.current_document},
        "proposed": {"document": conflict.proposed_document},
        "fields": [
            {
                "path": row.get("path", ""),
                "base": row.get("base"),
                "current": row.get("current"),
                "proposed": row.get("proposed"),
                "change": row.get("change", "both"),
            }
            for row in (conflict.fields or [])
        ],
        "resolution": resolution,
        "created_at": iso(conflict.created_at),
    }


@router.get(
    "/conflicts",
    auth=person_token,
    response={200: ConflictPage, **errors(400, 401, 403, 422)},
    summary="Conflicts visible to the caller (mine=true: those the caller may resolve)",
    tags=["conflicts"],
)
def conflict_list(
    request: HttpRequest,
    status: Literal["open", "resolved"] | None = None,
    mine: bool = False,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=TIME_CURSOR_PATTERN),
) -> HttpResponse:
    from ownership.selectors import conflict_list_for_person

    user = principal_of(request).user
    conflicts = conflict_list_for_person(user, mine=mine, status=status)
    page, next_cursor = time_page(conflicts, cursor=cursor, limit=limit)
    return json_response({"items": [conflict_json(c) for c in page], "next": next_cursor})


def _conflict_for(user: Any, conflict_id: uuid.UUID) -> Conflict:
    from ownership.selectors import conflict_get_for_person

    return conflict_get_for_person(user, conflict_id)


@router.get(
    "/conflicts/{conflict_id}",
    auth=person_token,
    response={200: ConflictOut, **errors(401, 403, 404, 422)},
    summary="A conflict with its three documents and field-level diff",
    tags=["conflicts"],
)
def conflict_get(request: HttpRequest, conflict_id: uuid.UUID) -> HttpResponse:
    return json_response(conflict_json(_conflict_for(principal_of(request).user, conflict_id)))


@router.post(
    "/conflicts/{conflict_id}/resolution",
    auth=person_token,
    response={200: ConflictOut, **errors(400, 401, 403, 404, 409, 413, 422, 429)},
    summary="Resolve a conflict (resolver group only)",
    tags=["conflicts"],
)
def conflict_resolution(
    request: HttpRequest, conflict_id: uuid.UUID, payload: ResolutionIn
) -> HttpResponse:
    from ownership.services.resolution import conflict_resolve

    principal = principal_of(request)
    _conflict_for(principal.user, conflict_id)
    rate_limit_writes(principal)
    conflict_resolve(
        conflict_id=conflict_id,
        actor=Actor.person(principal.user),
        choice=payload.choice,
        fields=dict(payload.fields),
        comment=payload.comment,
    )
    return json_response(conflict_json(_conflict_for(principal.user, conflict_id)))


# --- Conflict classes and resource kinds ------------------------------------------


@router.get(
    "/conflict-classes",
    auth=any_token,
    response={200: ConflictClassList, **errors(401)},
    summary="The conflict-class table",
    tags=["catalog"],
)
def conflict_class_list(request: HttpRequest) -> HttpResponse:
    items = [catalog.conflict_class_as_dict(c) for c in ConflictClass.objects.order_by("slug")]
    return json_response({"items": items})


@router.get(
    "/conflict-classes/{slug}",
    auth=any_token,
    response={200: ConflictClassOut, **errors(401, 404)},
    summary="One conflict class",
    tags=["catalog"],
)
def conflict_class_get(request: HttpRequest, slug: str = KindPath) -> HttpResponse:
    klass = ConflictClass.objects.filter(slug=slug).first()
    if klass is None:
        raise NotFound(f"Conflict class {slug!r} not found.")
    return json_response(catalog.conflict_class_as_dict(klass))


@router.put(
    "/conflict-classes/{slug}",
    auth=class_admin_token,
    response={200: ConflictClassOut, 201: ConflictClassOut, **errors(400, 401, 403, 413, 422, 429)},
    summary="Create or replace a conflict class (admins)",
    description="Takes the representation `GET` returned as it is: the read-only members "
    "(`slug`, `retryable_by_agent`, `updated_at`) are ignored when they match and a 422 "
    "names them when they contradict. A person who is not an admin gets 403 before the "
    "body is looked at.",
    tags=["catalog"],
)
def conflict_class_put(
    request: HttpRequest, payload: ConflictClassIn, slug: str = KindPath
) -> HttpResponse:
    principal = principal_of(request)
    rate_limit_writes(principal)
    klass, created = catalog.conflict_class_save(
        slug=slug, data=payload.model_dump(), actor=Actor.person(principal.user)
    )
    return json_response(catalog.conflict_class_as_dict(klass), status=201 if created else 200)


@router.get(
    "/resource-kinds",
    auth=any_token,
    response={200: ResourceKindList, **errors(401)},
    summary="Resource kinds and the class of each operation",
    tags=["catalog"],
)
def resource_kind_list(request: HttpRequest) -> HttpResponse:
    items = [catalog.resource_kind_as_dict(k) for k in ResourceKind.objects.order_by("slug")]
    return json_response({"items": items})


@router.get(
    "/resource-kinds/{kind}",
    auth=any_token,
    response={200: ResourceKindOut, **errors(401, 404)},
    summary="One resource kind",
    tags=["catalog"],
)
def resource_kind_get(request: HttpRequest, kind: str = KindPath) -> HttpResponse:
    found = ResourceKind.objects.filter(slug=kind).first()
    if found is None:
        raise NotFound(f"Resource kind {kind!r} not found.")
    return json_response(catalog.resource_kind_as_dict(found))


@router.put(
    "/resource-kinds/{kind}",
    auth=kind_admin_token,
    response={200: ResourceKindOut, 201: ResourceKindOut, **errors(400, 401, 403, 413, 422, 429)},
    summary="Create or replace a resource kind (admins)",
    description="Takes the representation `GET` returned as it is: the read-only members "
    "(`kind`, `updated_at`) are ignored when they match and a 422 names them when they "
    "contradict. A person who is not an admin gets 403 before the body is looked at.",
    tags=["catalog"],
)
def resource_kind_put(
    request: HttpRequest, payload: ResourceKindIn, kind: str = KindPath
) -> HttpResponse:
    principal = principal_of(request)
    rate_limit_writes(principal)
    found, created = catalog.resource_kind_save(
        slug=kind, data=payload.model_dump(), actor=Actor.person(principal.user)
    )
    return json_response(catalog.resource_kind_as_dict(found), status=201 if created else 200)
