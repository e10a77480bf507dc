from __future__ import annotations

from django.apps import AppConfig


class OwnershipConfig(AppConfig):
    name = "ownership"
