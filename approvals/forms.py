"""Forms of the approvals, runs and tokens pages."""

from __future__ import annotations

from django import forms

from approvals.models import ActionStatus, Agent, RunStatus
from ownership.models import ResourceKind


class DecisionForm(forms.Form):
    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("reject", "Reject")])
    comment = forms.CharField(max_length=2000, required=False, widget=forms.Textarea)

    def clean(self) -> dict[str, object]:
        data = super().clean() or {}
        if data.get("decision") == "reject" and not (data.get("comment") or "").strip():
            self.add_error("comment", "Say why you reject: the agent and the audit trail see it.")
        return data


class RunFilterForm(forms.Form):
    status = forms.ChoiceField(choices=[("", "any"), *RunStatus.choices], required=False)
    agent = forms.SlugField(max_length=100, required=False)
    action_status = forms.ChoiceField(
        choices=[("", "any"), *ActionStatus.choices], required=False, label="With an action"
    )


class RevokeForm(forms.Form):
    reason = forms.CharField(max_length=500)
    confirm = forms.BooleanField(required=True)


class PersonalTokenCreateForm(forms.Form):
    label = forms.CharField(max_length=100)


class AgentCreateForm(forms.Form):
    """Parses the agent form; `approvals.services.tokens.agent_create` validates it."""

    name = forms.CharField(max_length=100)
    description = forms.CharField(max_length=1000, required=False)
    owner = forms.CharField(
        max_length=150,
        required=False,
        help_text="The accountable person (username); the class may forbid them approving it.",
    )


class AgentTokenCreateForm(forms.Form):
    label = forms.CharField(max_length=100, required=False)


class AutoApproveRuleForm(forms.Form):
    """Parses the rule form; `approvals.services.rules` validates the values."""

    kind = forms.ChoiceField(choices=())
    name_prefix = forms.CharField(
        max_length=255,
        required=False,
        label="Name prefix",
        help_text="Resources whose name starts with this; empty covers the whole kind.",
    )
    operations = forms.MultipleChoiceField(
        choices=[(op, op) for op in ("create", "update", "delete")],
        widget=forms.CheckboxSelectMultiple,
    )
    agent = forms.ChoiceField(choices=(), required=False, label="Only for agent")
    description = forms.CharField(max_length=200, required=False)
    enabled = forms.BooleanField(required=False, initial=True)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        kinds = list(ResourceKind.objects.order_by("slug").values_list("slug", flat=True))
        agents = list(Agent.objects.order_by("name").values_list("name", flat=True))
        kind_field = self.fields["kind"]
        agent_field = self.fields["agent"]
        assert isinstance(kind_field, forms.ChoiceField)
        assert isinstance(agent_field, forms.ChoiceField)
        kind_field.choices = [(k, k) for k in kinds]
        agent_field.choices = [("", "any agent"), *((a, a) for a in agents)]
