"""The one JSON shape of a resource and of a conflict at the API."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from console.api_support import iso
from ownership.models import Conflict, Resource, version_etag


@dataclass(slots=True)
class ListedResource:
    """A resource's columns that resource_json renders, for a page of many read without the
    cost of a model instance each (about 9 µs a row, most of a page's rendering; the read
    front's list, approvals/api/fastpoll_routes.py). Its fields are LISTED_COLUMNS."""

    kind_id: str
    name: str
    document: Any
    version: int
    external_version: str | None
    owner_group: str
    updated_at: datetime


# The columns (Resource's attnames) a ListedResource is made of, in its fields' order.
LISTED_COLUMNS: tuple[str, ...] = tuple(ListedResource.__dataclass_fields__)


def resource_json(resource: Resource | ListedResource) -> dict[str, Any]:
    return {
        "kind": resource.kind_id,
        "name": resource.name,
        "version": resource.external_version
        if resource.external_version is not None
        else resource.version,
        "etag": version_etag(resource.version, resource.external_version),
        "document": resource.document,
        "owner_group": resource.owner_group,
        "updated_at": iso(resource.updated_at),
    }


def conflict_json(conflict: Conflict) -> dict[str, Any]:
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
        "resolution": _resolution_json(conflict),
        "created_at": iso(conflict.created_at),
    }


def _resolution_json(conflict: Conflict) -> dict[str, Any] | None:
    """How it was settled: the person's choice, or none for a conflict resolved
    without one."""
    if not conflict.resolution and conflict.status != "resolved":
        return None
    chosen = bool(conflict.resolution)
    return {
        "choice": conflict.resolution if chosen else None,
        "fields": (conflict.resolution_fields or {}) if chosen else {},
        "comment": conflict.resolution_comment,
        "by": conflict.resolved_by.get_username() if conflict.resolved_by else None,
        "at": iso(conflict.resolved_at),
        "action": (
            str(conflict.resolution_action_id) if chosen and conflict.resolution_action_id else None
        ),
    }
