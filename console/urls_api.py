from __future__ import annotations

from django.urls import URLPattern, URLResolver

# Owner: API helper — /api/v1/..., /healthz, /metrics.
urlpatterns: list[URLPattern | URLResolver] = []
