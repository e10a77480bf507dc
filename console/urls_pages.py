from __future__ import annotations

from django.urls import URLPattern, URLResolver

# Owner: console helper — login, dashboard and every page.
urlpatterns: list[URLPattern | URLResolver] = []
