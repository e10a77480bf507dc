"""API: the catalog — the conflict-class table and the resource kinds (admins write)."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django.db import models
from django.http import HttpRequest, HttpResponse
from ninja import Router, Schema

from audit.services import Actor
from console.api_support import RoleBearer, json_response, writing_principal
from console.auth import any_token
from console.permissions import is_admin
from console.problems import errors
from engine.core.errors import NotFound
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

router = Router(tags=["catalog"])

# Admin endpoints decide 401/403 before the body is validated (no schema leak).
class_admin_token = RoleBearer(is_admin, "Only admins edit the conflict-class table.")
kind_admin_token = RoleBearer(is_admin, "Only admins edit resource kinds.")

Row = TypeVar("Row", bound=models.Model)


@dataclass(frozen=True)
class _Table(Generic[Row]):
    """One catalog table as the API serves it: every row, one row by slug, and a
    create-or-replace by an admin through the table's audited save verb."""

    model: type[Row]
    noun: str
    as_dict: Callable[[Row], dict[str, Any]]
    save: Callable[..., tuple[Row, bool]]

    def rows(self) -> HttpResponse:
        items = [self.as_dict(row) for row in self.model._default_manager.order_by("slug")]
        return json_response({"items": items})

    def row(self, slug: str) -> HttpResponse:
        found = self.model._default_manager.filter(slug=slug).first()
        if found is None:
            raise NotFound(f"{self.noun} {slug!r} not found.")
        return json_response(self.as_dict(found))

    def put(self, request: HttpRequest, payload: Schema, slug: str) -> HttpResponse:
        principal = writing_principal(request)
        saved, created = self.save(
            slug=slug, data=payload.model_dump(), actor=Actor.person(principal.user)
        )
        return json_response(self.as_dict(saved), status=201 if created else 200)


CLASSES = _Table(
    ConflictClass, "Conflict class", catalog.conflict_class_as_dict, catalog.conflict_class_save
)
KINDS = _Table(
    ResourceKind, "Resource kind", catalog.resource_kind_as_dict, catalog.resource_kind_save
)


@router.get(
    "/conflict-classes",
    auth=any_token,
    response={200: ConflictClassList, **errors(401)},
    summary="The conflict-class table",
)
def conflict_class_list(request: HttpRequest) -> HttpResponse:
    return CLASSES.rows()


@router.get(
    "/conflict-classes/{slug}",
    auth=any_token,
    response={200: ConflictClassOut, **errors(401, 404)},
    summary="One conflict class",
)
def conflict_class_get(request: HttpRequest, slug: str = KindPath) -> HttpResponse:
    return CLASSES.row(slug)


@router.put(
    "/conflict-classes/{slug}",
    auth=class_admin_token,
    response={200: ConflictClassOut, 201: ConflictClassOut, **errors(400, 401, 403, 413, 422, 429)},
    summary="Create or replace a conflict class (admins)",
    description="Takes the representation `GET` returned as it is: the read-only members "
    "(`slug`, `retryable_by_agent`, `updated_at`) are ignored when they match and a 422 "
    "names them when they contradict. A person who is not an admin gets 403 before the "
    "body is looked at.",
)
def conflict_class_put(
    request: HttpRequest, payload: ConflictClassIn, slug: str = KindPath
) -> HttpResponse:
    return CLASSES.put(request, payload, slug)


@router.get(
    "/resource-kinds",
    auth=any_token,
    response={200: ResourceKindList, **errors(401)},
    summary="Resource kinds and the class of each operation",
)
def resource_kind_list(request: HttpRequest) -> HttpResponse:
    return KINDS.rows()


@router.get(
    "/resource-kinds/{kind}",
    auth=any_token,
    response={200: ResourceKindOut, **errors(401, 404)},
    summary="One resource kind",
)
def resource_kind_get(request: HttpRequest, kind: str = KindPath) -> HttpResponse:
    return KINDS.row(kind)


@router.put(
    "/resource-kinds/{kind}",
    auth=kind_admin_token,
    response={200: ResourceKindOut, 201: ResourceKindOut, **errors(400, 401, 403, 413, 422, 429)},
    summary="Create or replace a resource kind (admins)",
    description="Takes the representation `GET` returned as it is: the read-only members "
    "(`kind`, `updated_at`) are ignored when they match and a 422 names them when they "
    "contradict. A person who is not an admin gets 403 before the body is looked at.",
)
def resource_kind_put(
    request: HttpRequest, payload: ResourceKindIn, kind: str = KindPath
) -> HttpResponse:
    return KINDS.put(request, payload, kind)
