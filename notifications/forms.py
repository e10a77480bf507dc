"""The console's subscription form (the services validate again: one rule, one place)."""

from __future__ import annotations

from typing import Any

from django import forms

from notifications.models import Channel
from notifications.services.events import NOTIFICATION_TYPES


class UnechoedInput(forms.TextInput):
    """A text box that never renders a submitted value back: a webhook or Apprise URL
    carries tokens, and a refused one is typed again rather than shown in the page."""

    def get_context(self, name: str, value: Any, attrs: dict[str, Any] | None) -> dict[str, Any]:
        return super().get_context(name, None, attrs)


class SubscriptionForm(forms.Form):
    name = forms.CharField(max_length=100)
    target = forms.CharField(
        max_length=150, initial="*", help_text="A group's name (operators, owners, …) or *"
    )
    channel = forms.ChoiceField(choices=Channel.choices)
    url = forms.CharField(
        max_length=2000,
        required=False,
        label="URL",
        widget=UnechoedInput(attrs={"autocomplete": "off", "spellcheck": "false"}),
        help_text=(
            "Webhook: https://…  Apprise: slack://…, workflows://… (Teams), ntfys://…  Email: none"
        ),
    )
    event_types = forms.MultipleChoiceField(
        choices=[(t, t) for t in NOTIFICATION_TYPES],
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every event",
    )
    kind = forms.CharField(max_length=64, required=False, label="Resource kind")
    name_prefix = forms.CharField(max_length=255, required=False)
