"""Template filters for the diff partials (templates/approvals/partials/_diff*.html)."""

from __future__ import annotations

from typing import Any

from django import template

from ownership.diff import element_diff, element_diff_text

register = template.Library()


@register.filter
def elements(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A document_diff row's arrays aligned element by element (None: not two arrays)."""
    return element_diff_text(row.get("old"), row.get("new"))


@register.filter
def elements_from(new: Any, old: Any) -> list[dict[str, Any]] | None:
    """`{{ row.current|elements_from:row.base }}`: two raw values' arrays, per element."""
    return element_diff(old, new)
