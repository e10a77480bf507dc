from __future__ import annotations

from django.urls import URLPattern, URLResolver, include, path

from bench.views import bare_token_view

urlpatterns: list[URLPattern | URLResolver] = [
    path("bench/bare/actions/<uuid:action_id>", bare_token_view),
    path("", include("console.urls")),
]
