from __future__ import annotations

from django.contrib import admin

from console.admin import ReadOnlyAdmin
from ownership.models import (
    Conflict,
    ConflictClass,
    OwnershipRecord,
    Resource,
    ResourceKind,
    ResourceVersion,
)


# Classes and kinds are edited on the console's catalog page, where the change is
# audited; the admin shows them read-only.
@admin.register(ConflictClass)
class ConflictClassAdmin(ReadOnlyAdmin):
    list_display = (
        "slug",
        "approval_mode",
        "on_conflict",
        "resolver",
        "quorum",
        "undo_window_seconds",
    )


@admin.register(ResourceKind)
class ResourceKindAdmin(ReadOnlyAdmin):
    list_display = ("slug", "class_create", "class_update", "class_delete", "owner_group", "target")


@admin.register(Resource)
class ResourceAdmin(ReadOnlyAdmin):
    list_display = ("__str__", "version", "owner_group", "deleted", "updated_at")
    list_filter = ("kind",)
    search_fields = ("name",)
    # Documents, versions and fences change only through the write barrier.


@admin.register(ResourceVersion)
class ResourceVersionAdmin(ReadOnlyAdmin):
    list_display = ("resource", "version", "operation", "fence", "run", "created_at")
    list_select_related = ("resource", "run")


@admin.register(OwnershipRecord)
class OwnershipRecordAdmin(ReadOnlyAdmin):
    list_display = ("pattern", "run", "exclusive", "fence", "active", "expires_at")
    list_filter = ("active", "exclusive")


@admin.register(Conflict)
class ConflictAdmin(ReadOnlyAdmin):
    list_display = ("id", "resource", "conflict_class", "resolver", "status", "created_at")
    list_filter = ("status", "conflict_class")
