"""API: the catalog — the conflict-class table and the resource kinds (admins write)."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from ninja import Router

from audit.services import Actor
from console.api_support import RoleBearer, json_response, rate_limit_writes
from console.auth import any_token, principal_of
from console.core.errors import NotFound
from console.permissions import is_admin
from console.problems import errors
from ownership.api.schemas import (
    ConflictClassIn,
    ConflictClassList,
    ConflictClassOut,
    KindPath,
    ResourceKindIn,
    ResourceKindList,
    ResourceKindOut,
)
from ownership.models import ConflictClass, ResourceKind
from ownership.services import catalog

router = Router()

# Admin endpoints decide 401/403 before the body is validated (no schema leak).
class_admin_token = RoleBearer(is_admin, "Only admins edit the conflict-class table.")
kind_admin_token = RoleBearer(is_admin, "Only admins edit resource kinds.")


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
