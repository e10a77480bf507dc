from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Airlock console"

    def ready(self) -> None:
        from console import checks  # noqa: F401  (registers the deploy checks)
        from engine.core.fence import ensure_fence_floor_after_migrate

        # Once per `migrate` (sent for this app after every app has migrated).
        post_migrate.connect(
            ensure_fence_floor_after_migrate, sender=self, dispatch_uid="airlock.fence_floor"
        )
