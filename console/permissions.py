"""Who may do what. Roles are Django groups; owner groups are groups too.

Selectors and services ask these predicates; views never test groups by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import JSONField
from django.db.models.expressions import RawSQL

from audit.models import ActorType
from audit.services import Actor
from engine.core.errors import Forbidden

ROLE_OPERATOR = "operators"
ROLE_OWNER = "owners"
ROLE_ADMIN = "admins"
ROLE_AUDITOR = "auditors"
ROLES = {
    "operator": ROLE_OPERATOR,
    "owner": ROLE_OWNER,
    "admin": ROLE_ADMIN,
    "auditor": ROLE_AUDITOR,
}


def user_groups(user: Any) -> frozenset[str]:
    """The names of the user's groups, cached on the user object for the request."""
    if not getattr(user, "is_authenticated", False):
        return frozenset()
    cached: frozenset[str] | None = getattr(user, "_airlock_groups", None)
    if cached is None:
        cached = frozenset(user.groups.values_list("name", flat=True))
        user._airlock_groups = cached
    return cached


def group_names_of(user_id_column: str) -> RawSQL:
    """The names of the groups of the user whose id is `user_id_column` (a quoted column of
    the outer query), as a JSON array: read with the row that names the user (a personal
    token's lookup) instead of one more query when a role is checked (`remember_groups`)."""
    user = get_user_model()
    groups: Any = user._meta.get_field("groups")  # the ManyToManyField to Group
    through, group = groups.remote_field.through, groups.related_model
    to_user, to_group = (
        str(next(f.column for f in through._meta.concrete_fields if f.related_model is model))
        for model in (user, group)
    )
    quote = connection.ops.quote_name
    aggregate = "jsonb_agg" if connection.vendor == "postgresql" else "json_group_array"
    sql = (
        f"(SELECT {aggregate}(g.{quote('name')}) FROM {quote(through._meta.db_table)} ug "  # noqa: S608
        f"JOIN {quote(group._meta.db_table)} g ON g.id = ug.{quote(to_group)} "
        f"WHERE ug.{quote(to_user)} = {user_id_column})"
    )
    return RawSQL(sql, (), output_field=JSONField())  # noqa: S611 - no values, names quoted


def remember_groups(user: Any, names: Any) -> None:
    """Cache the group names `group_names_of` read on `user`, for `user_groups`."""
    if isinstance(names, str):  # SQLite: the aggregate can come back as JSON text
        names = json.loads(names)
    user._airlock_groups = frozenset(str(name) for name in names or ())


def is_admin(user: Any) -> bool:
    return bool(getattr(user, "is_superuser", False)) or ROLE_ADMIN in user_groups(user)


def is_operator(user: Any) -> bool:
    return is_admin(user) or ROLE_OPERATOR in user_groups(user)


def is_auditor(user: Any) -> bool:
    return ROLE_AUDITOR in user_groups(user)


def can_read_everything(user: Any) -> bool:
    """Operators, admins and auditors see every run, resource, action and event."""
    return is_operator(user) or is_auditor(user)


def resolver_group(resolver: str, owner_group: str) -> str:
    """The group that settles a conflict: '' when the agent itself resolves."""
    if resolver == "owner":
        return owner_group
    if resolver.startswith("group:"):
        return resolver.removeprefix("group:")
    return ""


def can_decide_approvals(user: Any) -> bool:
    """Deciding run and call approvals needs the operator role (admins have it)."""
    return is_operator(user)


def can_undo_as_person(user: Any, *, owner_group: str) -> bool:
    return is_operator(user) or owner_group in user_groups(user)


def person_of(actor: Actor) -> Any:
    """The active user a person actor names; None for the system, agents, runs, and
    for a person since deactivated or deleted."""
    if actor.type != ActorType.PERSON or not actor.id.isdigit():
        return None
    return get_user_model().objects.filter(pk=int(actor.id), is_active=True).first()


def require_person(actor: Actor, allowed: Callable[[Any], bool], message: str) -> Any:
    """Authorise a verb done by a person: returns the active person behind `actor`
    when `allowed(person)`, else raises Forbidden (agents and runs never pass).

    The system (management commands, housekeeping, the demo) is trusted and
    gets None: whoever runs manage.py already holds the database.
    """
    if actor.type == ActorType.SYSTEM:
        return None
    person = person_of(actor)
    if person is None or not allowed(person):
        raise Forbidden(message, code="forbidden")
    return person
