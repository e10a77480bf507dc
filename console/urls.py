"""URL assembly. The API routes live in console/urls_api.py, the console pages in
console/urls_pages.py, so the two areas never edit the same file."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    # django-rq's queue dashboard (queues, workers, failed and scheduled jobs): its views
    # require a staff login (the console's session), as the admin does.
    path("admin/rq/", include("django_rq.urls")),
    path("admin/", admin.site.urls),
    path("", include("console.urls_api")),
    path("notifications/", include("notifications.urls")),
    path("", include("console.urls_pages")),
]
