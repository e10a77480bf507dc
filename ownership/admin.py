from __future__ import annotations

from console.admin import register_read_only
from ownership.models import (
    Conflict,
    ConflictClass,
    OwnershipRecord,
    Resource,
    ResourceKind,
    ResourceVersion,
)

register_read_only(
    {
        # Classes and kinds are edited on the console's catalog page, where the change is
        # audited; the admin shows them read-only.
        ConflictClass: {
            "list_display": (
                "slug",
                "approval_mode",
                "on_conflict",
                "resolver",
                "quorum",
                "undo_window_seconds",
            ),
        },
        ResourceKind: {
            "list_display": (
                "slug",
                "class_create",
                "class_update",
                "class_delete",
                "owner_group",
                "target",
            ),
        },
        # Documents, versions and fences change only through the write barrier.
        Resource: {
            "list_display": ("__str__", "version", "owner_group", "deleted", "updated_at"),
            "list_filter": ("kind",),
            "search_fields": ("name",),
        },
        ResourceVersion: {
            "list_display": ("resource", "version", "operation", "fence", "run", "created_at"),
            "list_select_related": ("resource", "run"),
        },
        OwnershipRecord: {
            "list_display": ("pattern", "run", "exclusive", "fence", "active", "expires_at"),
            "list_filter": ("active", "exclusive"),
        },
        Conflict: {
            "list_display": (
                "id",
                "resource",
                "conflict_class",
                "resolver",
                "status",
                "created_at",
            ),
            "list_filter": ("status", "conflict_class"),
        },
    }
)
