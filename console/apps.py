from __future__ import annotations

from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "console"
    verbose_name = "Airlock console"

    def ready(self) -> None:
        from console import checks  # noqa: F401  (registers the deploy checks)
