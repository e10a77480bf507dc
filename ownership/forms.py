"""Forms of the conflicts, resources and catalog pages."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from django import forms
from django.db import models
from django.forms.models import model_to_dict

from ownership.models import (
    ApprovalMode,
    ConflictClass,
    OnConflict,
    ResolutionChoice,
    TargetType,
)

_OPERATIONS = ("create", "update", "delete")
_RESOLVER = re.compile(r"^(agent|owner|group:[A-Za-z0-9_.@+-]+)$")


class ResolutionForm(forms.Form):
    choice = forms.ChoiceField(choices=ResolutionChoice.choices)
    comment = forms.CharField(max_length=2000, required=False, widget=forms.Textarea)


class ResourceFilterForm(forms.Form):
    kind = forms.SlugField(max_length=64, required=False)
    # The form metaclass moves fields off the class, so Form.prefix stays None.
    prefix = forms.CharField(max_length=255, required=False)  # type: ignore[assignment]


class UndoForm(forms.Form):
    confirm = forms.BooleanField(required=True)
    # The person's own reason (optional): kept on the undo, shown on its conflict and in
    # the audit trail as "<person>'s reason".
    reason = forms.CharField(max_length=500, required=False)


class CatalogRowForm(forms.Form):
    """The form of one catalog row; editing starts from the row's stored values."""

    noun: ClassVar[str]  # in the notice: "<noun> <slug> saved."
    context_name: ClassVar[str]  # the catalog page's context name for this form

    @classmethod
    def initial_from(cls, row: models.Model) -> dict[str, Any]:
        # model_to_dict gives a foreign key's slug, what the choice field submits.
        return model_to_dict(row, fields=list(cls.base_fields))

    def row_data(self) -> tuple[str, dict[str, Any]]:
        """The valid form as its save verb takes it: the slug and the rest."""
        data = dict(self.cleaned_data)
        return data.pop("slug"), data


class ConflictClassForm(CatalogRowForm):
    noun = "Conflict class"
    context_name = "class_form"

    slug = forms.SlugField(max_length=64)
    name = forms.CharField(max_length=200)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    approval_mode = forms.ChoiceField(choices=ApprovalMode.choices)
    on_conflict = forms.ChoiceField(choices=OnConflict.choices)
    resolver = forms.CharField(max_length=150, help_text="agent, owner or group:<name>")
    quorum = forms.IntegerField(min_value=1, max_value=20, initial=1)
    undo_window_seconds = forms.IntegerField(
        min_value=0, max_value=30 * 86400, initial=600, label="Undo window (seconds)"
    )
    approval_ttl_seconds = forms.IntegerField(
        min_value=60, max_value=30 * 86400, initial=172_800, label="Approval TTL (seconds)"
    )
    escalation_seconds = forms.IntegerField(min_value=0, max_value=30 * 86400, initial=0)
    escalation_group = forms.CharField(max_length=150, required=False)
    forbid_agent_owner_approval = forms.BooleanField(required=False, initial=True)
    grants_allowed = forms.BooleanField(
        required=False,
        initial=True,
        help_text="Approvers may give standing grants (approve and allow similar) for it.",
    )

    def clean_resolver(self) -> str:
        resolver: str = self.cleaned_data["resolver"].strip()
        if not _RESOLVER.match(resolver):
            raise forms.ValidationError("Resolver must be agent, owner or group:<name>.")
        return resolver


class ResourceKindForm(CatalogRowForm):
    noun = "Resource kind"
    context_name = "kind_form"

    slug = forms.SlugField(max_length=64)
    description = forms.CharField(required=False, max_length=1000)
    class_create = forms.ModelChoiceField(
        queryset=ConflictClass.objects.all(), to_field_name="slug"
    )
    class_update = forms.ModelChoiceField(
        queryset=ConflictClass.objects.all(), to_field_name="slug"
    )
    class_delete = forms.ModelChoiceField(
        queryset=ConflictClass.objects.all(), to_field_name="slug"
    )
    owner_group = forms.CharField(max_length=150)
    undo_window_seconds = forms.IntegerField(min_value=0, max_value=30 * 86400, required=False)
    target = forms.ChoiceField(choices=TargetType.choices, initial=TargetType.MANAGED)
    target_url = forms.URLField(required=False, assume_scheme="https")

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("target") == TargetType.HTTP and not data.get("target_url"):
            self.add_error("target_url", "An HTTP target needs its URL.")
        return data

    def row_data(self) -> tuple[str, dict[str, Any]]:
        slug, data = super().row_data()
        data["classes"] = {
            op: data.pop(f"class_{op}").slug for op in ("create", "update", "delete")
        }
        return slug, data
