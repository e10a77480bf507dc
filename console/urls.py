"""URL assembly. The API routes live in console/urls_api.py, the console pages in
console/urls_pages.py, so the two areas never edit the same file."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("console.urls_api")),
    path("notifications/", include("notifications.urls")),
    path("", include("console.urls_pages")),
]
