"""Read-side queries for conflicts and resources, filtered to what the person may see."""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import Q, QuerySet

from console.permissions import can_read_everything, user_groups
from engine.core.errors import NotFound
from ownership.models import Conflict, ConflictStatus, Resource


def conflict_list_for_person(
    person: Any, *, mine: bool = False, status: str | None = None
) -> QuerySet[Conflict]:
    """Conflicts the person may see; `mine=True`: only those they may resolve
    (their group is the resolver group), newest first."""
    qs = Conflict.objects.select_related(
        "action__run__agent", "action__kind", "resource", "conflict_class", "resolved_by"
    )
    if status:
        qs = qs.filter(status=status)
    groups = user_groups(person)
    if mine:
        return qs.filter(resolver_group__in=groups).exclude(resolver_group="")
    if can_read_everything(person):
        return qs
    if not groups:
        return qs.none()
    return qs.filter(Q(resolver_group__in=groups) | Q(resource__owner_group__in=groups))


def conflict_get_for_person(person: Any, conflict_id: Any) -> Conflict:
    try:
        conflict_uuid = uuid.UUID(str(conflict_id))
    except ValueError as exc:
        raise NotFound("No such conflict.") from exc
    conflict = conflict_list_for_person(person).filter(pk=conflict_uuid).first()
    if conflict is None:
        raise NotFound("No such conflict.")
    return conflict


def conflict_may_resolve(*, conflict: Conflict, person: Any) -> bool:
    """Is the person active and in the group this conflict is assigned to?"""
    if not getattr(person, "is_active", False) or not conflict.resolver_group:
        return False
    return conflict.resolver_group in user_groups(person)


def open_conflict_count(person: Any) -> int:
    return conflict_list_for_person(person, mine=True, status=ConflictStatus.OPEN).count()


def resource_live(*, kind: str, name: str) -> QuerySet[Resource]:
    """kind/name unless deleted: what an agent reads (GET /api/v1/resources/{kind}/{name}, in
    Django and in the read front, approvals/api/fastpoll.py, which runs its SQL)."""
    return Resource.objects.filter(kind_id=kind, name=name, deleted=False)


def resources_listed(*, kind: str | None, prefix: str | None) -> QuerySet[Resource]:
    """The live resources of `kind` whose name starts with `prefix` (either may be absent):
    what an agent lists (GET /api/v1/resources, in Django and in the read front,
    approvals/api/fastpoll_routes.py, which runs its SQL). Any live token lists them all."""
    resources = Resource.objects.filter(deleted=False)
    if kind:
        resources = resources.filter(kind_id=kind)
    if prefix:
        resources = resources.filter(name__startswith=prefix)
    return resources


def resource_list(*, kind: str | None = None, prefix: str | None = None) -> QuerySet[Resource]:
    qs = Resource.objects.select_related("kind")
    if kind:
        qs = qs.filter(kind_id=kind)
    if prefix:
        qs = qs.filter(name__startswith=prefix)
    return qs.order_by("kind_id", "name")
