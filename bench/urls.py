from __future__ import annotations

from django.urls import URLPattern, path

from bench.views import bare_insert_view, bare_token_view

urlpatterns: list[URLPattern] = [
    path("bench/bare/actions/<uuid:action_id>", bare_token_view),
    path("bench/bare/proposals/<str:kind>/<str:name>", bare_insert_view),
]
