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
    }
