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


@register(Tags.security, deploy=True)
def metrics_token_set(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    """/metrics is open without METRICS_TOKEN: anyone who reaches the site reads
    the deployment's activity (actions, conflicts, latencies, request routes)."""
    if getattr(settings, "METRICS_TOKEN", ""):
        return []
    return [
        Warning(
            "METRICS_TOKEN is not set: /metrics answers anyone who can reach the site.",
            hint="Set METRICS_TOKEN to a long random value and configure the scraper to send "
            "Authorization: Bearer <METRICS_TOKEN>.",
            id="airlock.W010",
        )
    ]
