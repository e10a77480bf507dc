"""Forms of the console pages (dashboard, kill switch)."""

from __future__ import annotations

import re
from typing import Any

from django import forms

from engine.core.killswitch import SCOPE_HELP, SCOPE_MAX_LENGTH, scope_is_valid


class KillSwitchForm(forms.Form):
    action = forms.ChoiceField(
        choices=[("engage", "Engage"), ("release", "Release")], widget=forms.HiddenInput
    )
    scope = forms.CharField(
        max_length=SCOPE_MAX_LENGTH,
        initial="*",
        help_text="* for everything, or kind/prefix* (e.g. dns-record/prod-*).",
    )
    reason = forms.CharField(max_length=500, required=False, widget=forms.TextInput)
    confirm = forms.BooleanField(
        required=True,
        label="I understand this stops or resumes writes in this scope",
        error_messages={"required": "Tick the confirmation box to change the kill switch."},
    )

    def clean_scope(self) -> str:
        scope: str = self.cleaned_data["scope"].strip()
        if not scope_is_valid(scope):
            raise forms.ValidationError(f"Scope must be {SCOPE_HELP}.")
        return scope

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("action") == "engage" and not (data.get("reason") or "").strip():
            self.add_error("reason", "Say why: the reason is shown on every page and audited.")
        return data


ROLE_CHOICES = [
    ("operator", "operator (decides approvals, kill switch)"),
    ("owner", "resource owner"),
    ("admin", "admin"),
    ("auditor", "auditor (reads everything)"),
]


def _group_list(value: str) -> list[str]:
    return sorted({g for g in re.split(r"[\s,]+", value or "") if g})


class PersonUpdateForm(forms.Form):
    """Parses the people forms; `console.people` validates the values."""

    roles = forms.MultipleChoiceField(choices=ROLE_CHOICES, widget=forms.CheckboxSelectMultiple)
    groups = forms.CharField(
        max_length=2000,
        required=False,
        label="Owner groups",
        help_text="Comma- or space-separated, e.g. platform release-owners.",
    )

    def clean_groups(self) -> list[str]:
        return _group_list(self.cleaned_data.get("groups") or "")


class PersonCreateForm(PersonUpdateForm):
    username = forms.CharField(max_length=150)
    password = forms.CharField(
        max_length=256, widget=forms.PasswordInput(render_value=False), strip=False
    )
    field_order = ["username", "password", "roles", "groups"]
