"""Filters of the audit page."""

from __future__ import annotations

from typing import Any

from django import forms


class AuditFilterForm(forms.Form):
    resource = forms.CharField(max_length=320, required=False)
    run = forms.UUIDField(required=False)
    action = forms.UUIDField(required=False)
    agent = forms.SlugField(max_length=100, required=False, label="Actor: agent")
    person = forms.CharField(max_length=150, required=False, label="Actor: person")
    # Chosen from a list (the types the trail holds, and each family's "all"); still a
    # CharField, so a bookmarked type or a family prefix ("write.*") keeps filtering.
    type = forms.CharField(max_length=64, required=False, label="Event type", widget=forms.Select)
    since = forms.DateTimeField(
        required=False,
        label="From (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
    )
    until = forms.DateTimeField(
        required=False,
        label="Until (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
    )

    def __init__(self, *args: Any, event_types: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["type"].widget.choices = event_type_choices(
            event_types or [], chosen=str(self.data.get("type", "") or "")
        )


def event_type_choices(event_types: list[str], *, chosen: str = "") -> list[tuple[str, Any]]:
    """Any type; then per family (the part before the first dot) "every <family> event"
    and each type of it; a chosen value the list lacks is kept, so it shows selected."""
    families: dict[str, list[str]] = {}
    for name in event_types:
        families.setdefault(name.partition(".")[0], []).append(name)
    choices: list[tuple[str, Any]] = [("", "any event type")]
    for family, names in sorted(families.items()):
        options = [(f"{family}.*", f"every {family} event")] + [(n, n) for n in names]
        choices.append((family, options))
    known = {value for _, group in choices[1:] for value, _ in group}
    if chosen and chosen not in known:
        choices.append((chosen, chosen))
    return choices
