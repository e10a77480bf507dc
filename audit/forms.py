"""Filters of the audit page."""

from __future__ import annotations

from django import forms


class AuditFilterForm(forms.Form):
    resource = forms.CharField(max_length=320, required=False)
    run = forms.UUIDField(required=False)
    action = forms.UUIDField(required=False)
    agent = forms.SlugField(max_length=100, required=False)
    person = forms.CharField(max_length=150, required=False)
    type = forms.CharField(max_length=64, required=False, label="Event type")
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
