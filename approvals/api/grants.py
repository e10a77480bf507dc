"""API: standing grants ("approve and allow similar", docs/grants.md).

Made with an approval (`grant` on POST /approvals/{id}/decision); listed, read and
revoked here. Operators, admins and auditors see every grant, anyone else their own;
the owner or an admin revokes.
"""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import uuid
from typing import Literal

from django.db.models import F, Q
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Path, Query, Router

from approvals.api.schemas import GrantOut, GrantPage
from approvals.models import RunStatus
from approvals.services.grants import (
    grant_as_dict,
    grant_get_for_person,
    grant_revoke,
    grants_visible_to,
)
from console.api_support import Keyset, json_response, page_response, writing_principal
from console.auth import person_token, principal_of
from console.problems import errors

router = Router(auth=person_token, tags=["grants"])

_MAX_GRANT_ID = 2**63 - 1
_GRANT_ID = Path(..., ge=1, le=_MAX_GRANT_ID)
# Newest first, by id; the cursor is the last id.
_NEWEST_ID = Keyset(
    ("id",), True, lambda values: str(values[0]), lambda raw: [min(int(raw), _MAX_GRANT_ID)]
)


@router.get(
    "/grants",
    response={200: GrantPage, **errors(400, 401, 403, 422)},
    summary="Standing grants the caller may see, newest first",
    description="Operators, admins and auditors see every grant; anyone else the grants they "
    "made. `state=live`: only grants that can still admit a write (not revoked, spent or "
    "expired, and for a run's grant, the run still active).",
)
def grant_list(
    request: HttpRequest,
    state: Literal["all", "live"] = "all",
    run: uuid.UUID | None = None,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=r"^[0-9]{1,19}$", description="`next` of a page"),
) -> HttpResponse:
    grants = grants_visible_to(principal_of(request).user)
    if run is not None:
        grants = grants.filter(run_id=run)
    if state == "live":
        now = timezone.now()
        grants = grants.filter(
            Q(run__isnull=True) | Q(run__status=RunStatus.ACTIVE, run__expires_at__gt=now),
            revoked_at__isnull=True,
            used__lt=F("uses"),
            expires_at__gt=now,
        )
    return page_response(
        grants, keyset=_NEWEST_ID, cursor=cursor, limit=limit, render=grant_as_dict
    )


@router.get(
    "/grants/{grant_id}",
    response={200: GrantOut, **errors(401, 404, 422)},
    summary="One standing grant",
)
def grant_get(request: HttpRequest, grant_id: int = _GRANT_ID) -> HttpResponse:
    return json_response(grant_as_dict(grant_get_for_person(principal_of(request).user, grant_id)))


@router.delete(
    "/grants/{grant_id}",
    response={200: GrantOut, **errors(401, 403, 404, 422, 429)},
    summary="Revoke a standing grant (its owner or an admin; audited `grant.revoked`)",
    description="From the revoke on, the grant admits no write; writes it already admitted "
    "stand, and writes waiting for a person keep waiting. Revoking again answers the same.",
)
def grant_delete(request: HttpRequest, grant_id: int = _GRANT_ID) -> HttpResponse:
    principal = writing_principal(request)
    return json_response(grant_as_dict(grant_revoke(grant_id=grant_id, person=principal.user)))
