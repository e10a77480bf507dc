"""Small template filters for the console pages."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django import template

register = template.Library()


@register.filter
def compact_json(value: Any, limit: int = 300) -> str:
    """One-line JSON (autoescaped by the template), cut at `limit` characters."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@register.filter
def as_uuid(value: Any) -> str:
    """`value` as a canonical UUID, or "" when it is not one: audit details are
    free-form JSON, and a page builds a link only from a real id."""
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        return ""
