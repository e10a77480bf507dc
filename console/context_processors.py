from __future__ import annotations

from typing import Any

from django.http import HttpRequest


def console_context(request: HttpRequest) -> dict[str, Any]:
    """Values every console page needs (the kill-switch banner is filled in by the console)."""
    return {}
