from __future__ import annotations

from django.contrib import admin

from audit.models import AuditEvent, AuditHead
from console.admin import ReadOnlyAdmin


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ("seq", "created_at", "event_type", "actor_type", "actor_label", "resource")
    list_filter = ("event_type", "actor_type")
    search_fields = ("resource", "actor_label")
    show_full_result_count = False  # no COUNT(*) over a million rows


@admin.register(AuditHead)
class AuditHeadAdmin(ReadOnlyAdmin):
    list_display = ("seq", "hash")
