"""The console's subscription form (the services validate again: one rule, one place)."""

from __future__ import annotations

from django import forms

from notifications.models import Channel
from notifications.services.events import NOTIFICATION_TYPES


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
        help_text="Webhook: https://…  Apprise: slack://…, msteams://…, ntfys://…  Email: none",
    )
    event_types = forms.MultipleChoiceField(
        choices=[(t, t) for t in NOTIFICATION_TYPES],
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every event",
    )
    kind = forms.CharField(max_length=64, required=False, label="Resource kind")
    name_prefix = forms.CharField(max_length=255, required=False)
