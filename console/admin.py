from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.db.models import Model
from django.http import HttpRequest

from console.models import FenceCounter, KillSwitch


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """History is append-only: visible in the admin, never editable there.

    Without the change permission Django builds the change form with no fields (every
    one is shown read-only), so foreign keys never render as selects and need no
    raw_id_fields."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def register_read_only(options: Mapping[type[Model], Mapping[str, Any]]) -> None:
    """Each model in the admin read-only, with its ModelAdmin options (list_display, …):
    Django builds the `<Model>Admin` subclass of ReadOnlyAdmin from them."""
    for model, model_options in options.items():
        admin.site.register(model, ReadOnlyAdmin, **model_options)


@admin.register(KillSwitch)
class KillSwitchAdmin(ReadOnlyAdmin):
    """Engaged and released on the dashboard or the API, where it is audited."""

    list_display = ("scope", "engaged", "reason", "changed_by", "changed_at")


@admin.register(FenceCounter)
class FenceCounterAdmin(ReadOnlyAdmin):
    list_display = ("id", "value")


# People and their groups (roles, owner groups) decide who may approve and resolve:
# they change only on the audited People page or `manage.py person_create`.
admin.site.unregister(User)
admin.site.unregister(Group)


@admin.register(User)
class ReadOnlyUserAdmin(ReadOnlyAdmin, UserAdmin):  # type: ignore[type-arg]
    pass


@admin.register(Group)
class ReadOnlyGroupAdmin(ReadOnlyAdmin, GroupAdmin):
    pass
