"""The Notifications page's URLs (included under /notifications/ by console/urls.py)."""

from __future__ import annotations

from django.urls import URLPattern, path

from notifications import views

urlpatterns: list[URLPattern] = [
    path("", views.notifications_page, name="notifications"),
    path("log/", views.delivery_log, name="notifications_log"),
    path("mine/", views.my_notifications, name="my_notifications"),
    path("new/", views.subscription_create_view, name="notification_subscription_create"),
    path(
        "<int:subscription_id>/<slug:verb>/",
        views.subscription_verb_view,
        name="notification_subscription_verb",
    ),
]
