"""API: conflicts — list, read with the three documents, resolve."""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import uuid
from typing import Literal

from django.http import HttpRequest, HttpResponse
from ninja import Query, Router

from audit.services import Actor
from console.api_support import (
    NEWEST_FIRST,
    TIME_CURSOR_PATTERN,
    json_response,
    page_response,
    rate_limit_writes,
)
from console.auth import person_token, principal_of
from console.problems import errors
from ownership.api.schemas import ConflictOut, ConflictPage, ResolutionIn
from ownership.api.serialize import conflict_json
from ownership.selectors import conflict_get_for_person, conflict_list_for_person
from ownership.services.resolution import conflict_resolve

router = Router(auth=person_token, tags=["conflicts"])


@router.get(
    "/conflicts",
    response={200: ConflictPage, **errors(400, 401, 403, 422)},
    summary="Conflicts visible to the caller (mine=true: those the caller may resolve)",
)
def conflict_list(
    request: HttpRequest,
    status: Literal["open", "resolved"] | None = None,
    mine: bool = False,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=TIME_CURSOR_PATTERN),
) -> HttpResponse:
    conflicts = conflict_list_for_person(principal_of(request).user, mine=mine, status=status)
    return page_response(
        conflicts, keyset=NEWEST_FIRST, cursor=cursor, limit=limit, render=conflict_json
    )


@router.get(
    "/conflicts/{conflict_id}",
    response={200: ConflictOut, **errors(401, 403, 404, 422)},
    summary="A conflict with its three documents and field-level diff",
)
def conflict_get(request: HttpRequest, conflict_id: uuid.UUID) -> HttpResponse:
    conflict = conflict_get_for_person(principal_of(request).user, conflict_id)
    return json_response(conflict_json(conflict))


@router.post(
    "/conflicts/{conflict_id}/resolution",
    response={200: ConflictOut, **errors(400, 401, 403, 404, 409, 413, 422, 429)},
    summary="Resolve a conflict (resolver group only)",
)
def conflict_resolution(
    request: HttpRequest, conflict_id: uuid.UUID, payload: ResolutionIn
) -> HttpResponse:
    principal = principal_of(request)
    # A conflict the caller may not even see is a 404 (before the rate limit);
    # conflict_resolve decides who may resolve one they see (403).
    conflict_get_for_person(principal.user, conflict_id)
    rate_limit_writes(principal)
    conflict_resolve(
        conflict_id=conflict_id,
        actor=Actor.person(principal.user),
        choice=payload.choice,
        fields=dict(payload.fields),
        comment=payload.comment,
    )
    conflict = conflict_get_for_person(principal.user, conflict_id)
    return json_response(conflict_json(conflict))
