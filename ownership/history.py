"""A resource's documents by version token (issue 39: versions are opaque text).

Airlock's own store numbers its history rows with the resource's counter, so a token there
is the counter as text. A kind with an external target keeps a mirror row whose history rows
carry the target's token (`external_version`); a token is then looked up as it is."""

from __future__ import annotations

import copy
from typing import Any

from ownership.models import Resource, ResourceVersion

NO_VERSION = "0"  # the base of a create: nothing was there


def revision_filter(resource: Resource, token: str) -> dict[str, Any]:
    """The ResourceVersion lookup for `token` on this resource."""
    if resource.external_version is not None:
        return {"resource": resource, "external_version": token}
    return {"resource": resource, "version": int(token)}


def revision_at(resource: Resource, token: str | int | None) -> ResourceVersion | None:
    if token is None:
        return None
    token = str(token)
    if token == NO_VERSION:
        return None
    if resource.external_version is None and not token.isdigit():
        return None
    return ResourceVersion.objects.filter(**revision_filter(resource, token)).first()


def document_at(resource: Resource, token: str | int | None) -> dict[str, Any]:
    """The resource's document as of `token` ({} for none, a deletion, or one not recorded)."""
    if token is None:
        return {}
    token = str(token)
    if token == NO_VERSION:
        return {}
    if token == resource.token:
        return copy.deepcopy(resource.document) if not resource.deleted else {}
    row = revision_at(resource, token)
    if row is None or row.deleted:
        return {}
    return copy.deepcopy(row.document)


def base_token(resource: Resource, observed: str | None) -> str:
    """The base version a conflict names: what was observed; for a create, nothing ("0").
    On the managed store, never above the current counter (a resource recreated from a
    tombstone keeps counting)."""
    if observed is None:
        return NO_VERSION
    if resource.external_version is None and observed.isdigit():
        return str(min(int(observed), resource.version))
    return observed
