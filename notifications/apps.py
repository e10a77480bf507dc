from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks


class NotificationsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "notifications"

    def ready(self) -> None:
        checks.register(notify_key_check, checks.Tags.security, deploy=True)


def notify_key_check(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    # reason: settings are read at check time, after apps are loaded
    from notifications.services.secrets import notify_key_is_derived

    if not notify_key_is_derived():
        return []
    return [
        checks.Warning(
            "AIRLOCK_NOTIFY_KEY is not set: notification secrets are encrypted with a key "
            "derived from SECRET_KEY, so changing SECRET_KEY makes them unreadable.",
            hint="Set AIRLOCK_NOTIFY_KEY to a Fernet key (Fernet.generate_key()).",
            id="notifications.W001",
        )
    ]
