from __future__ import annotations

from django.contrib import admin

from console.models import FenceCounter, KillSwitch
from ownership.admin import ReadOnlyAdmin


@admin.register(KillSwitch)
class KillSwitchAdmin(ReadOnlyAdmin):
    """Engage and release from the dashboard, where it is confirmed and audited."""

    list_display = ("scope", "engaged", "reason", "changed_by", "changed_at")


@admin.register(FenceCounter)
class FenceCounterAdmin(ReadOnlyAdmin):
    list_display = ("id", "value")
