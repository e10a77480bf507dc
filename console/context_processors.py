from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.utils.functional import SimpleLazyObject

from console import permissions
from console.models import KillSwitch


def _engaged() -> list[KillSwitch]:
    return list(KillSwitch.objects.filter(engaged=True).select_related("changed_by"))


def _roles(user: Any) -> list[str]:
    groups = permissions.user_groups(user)
    return sorted(groups) + (["superuser"] if getattr(user, "is_superuser", False) else [])


def _roles_and_groups(user: Any) -> dict[str, list[str]]:
    """The header shows what a person may do (roles) apart from what they own
    (owner groups: the groups resources and conflicts are routed to)."""
    groups = permissions.user_groups(user)
    role_groups = set(permissions.ROLES.values())
    roles = [name for name, group in permissions.ROLES.items() if group in groups]
    if getattr(user, "is_superuser", False):
        roles.append("superuser")
    return {"roles": sorted(roles), "groups": sorted(groups - role_groups)}


def console_context(request: HttpRequest) -> dict[str, Any]:
    """Values every console page needs: the kill-switch banner and the person's roles.

    Lazy, so fragments and pages that do not show them cost no query.
    """
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {
        "engaged_switches": SimpleLazyObject(_engaged),
        "roles": SimpleLazyObject(lambda: _roles(user)),
        "who": SimpleLazyObject(lambda: _roles_and_groups(user)),
    }
