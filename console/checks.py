"""Deployment checks of Airlock's own (run by `manage.py check --deploy`)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Tags, Warning, register


@register(Tags.security, deploy=True)
def secret_key_from_environment(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    if getattr(settings, "SECRET_KEY_FROM_ENV", True):
        return []
    return [
        Warning(
            "SECRET_KEY is not set in the environment; a key generated into the data folder "
            "is used, which other machines of the deployment do not share.",
            hint="Set SECRET_KEY to the same long random value on every web process.",
            id="airlock.W001",
        )
    ]
