"""Rules the pages share with the API and the services, each defined once: the
code → status table, the kill-switch scope, and the document a write proposes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from approvals.models import Action
from audit.services import Actor
from console.forms import KillSwitchForm
from console.models import KillSwitch
from console.pages import error_status
from console.problems import PROBLEMS, problem_from_error
from console.services import kill_switch_set
from engine.core.errors import DomainError, ValidationFailed
from ownership.diff import document_diff, proposed_document
from tests.fixtures.api import ApiClient, Person
from tests.fixtures.console import People, World, client_for

# --- one status table -------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(PROBLEMS))
def test_it_answers_a_service_error_on_a_page_with_the_apis_status(code: str) -> None:
    error = DomainError("refused", code=code)
    assert error_status(error) == problem_from_error(error).status_code


@pytest.mark.parametrize(
    ("code", "status"),
    [
        # The pages' own table answered 409 for each of these.
        ("leased", 423),
        ("kill_switch_engaged", 503),
        ("stale_version", 412),
        ("not_in_write_set", 403),
        ("precondition_required", 428),
        ("rate_limited", 429),
    ],
)
def test_it_keeps_the_apis_status_for_the_codes_the_pages_had_drifted_on(
    code: str, status: int
) -> None:
    assert error_status(DomainError("refused", code=code)) == status


# --- one kill-switch scope rule ------------------------------------------------------------

SCOPES = [
    ("*", True),
    ("dns-record/prod-*", True),
    ("dns-record/prod-eu", True),
    ("dns_record/prod-*", True),  # the form refused an underscore in the kind
    ("dns-record/a@b+c=d,e", True),  # … and @ + = , in the name
    ("dns-record/a/b", False),  # the form accepted a slash in the name
    ("k" * 65 + "/prod-*", False),  # … and a kind longer than a slug
    ("dns-record/" + "n" * 255, False),
    ("Dns-record/prod", False),
    ("dns-record", False),
    ("dns-record/a*b", False),
    ("**", False),
]


@pytest.mark.parametrize(("scope", "accepted"), SCOPES)
def test_the_form_the_api_and_the_service_accept_the_same_scopes(
    scope: str, accepted: bool, api: ApiClient, operator: Person
) -> None:
    form = KillSwitchForm({"action": "engage", "scope": scope, "reason": "drill", "confirm": "on"})
    assert form.is_valid() is accepted, form.errors
    response = api.post(
        "/api/v1/kill-switch",
        token=operator.token,
        body={"engaged": True, "scope": scope, "reason": "drill"},
    )
    assert response.status_code == (200 if accepted else 422), response.content
    assert KillSwitch.objects.filter(scope=scope).exists() is accepted
    if accepted:
        kill_switch_set(scope=scope, engaged=False, reason="", actor=Actor.person(operator.user))
    else:
        with pytest.raises(ValidationFailed):
            kill_switch_set(
                scope=scope, engaged=True, reason="drill", actor=Actor.person(operator.user)
            )


# --- one proposed document and diff ----------------------------------------------------------


def _write(operation: str, payload_format: str, payload: Any) -> Any:
    return SimpleNamespace(operation=operation, payload_format=payload_format, payload=payload)


CURRENT = {"channels": ["email"], "severity": "high", "routing": {"team": "a", "tier": 1}}


def test_a_delete_proposes_the_empty_document_and_its_diff_removes_every_field() -> None:
    proposed = proposed_document(_write("delete", "delete", None), CURRENT)
    assert proposed == {}
    assert document_diff(CURRENT, proposed) == [
        {"path": "/channels", "old": '["email"]', "new": None, "kind": "removed"},
        {"path": "/routing/team", "old": '"a"', "new": None, "kind": "removed"},
        {"path": "/routing/tier", "old": "1", "new": None, "kind": "removed"},
        {"path": "/severity", "old": '"high"', "new": None, "kind": "removed"},
    ]


def test_a_merge_patch_applies_to_the_current_document_and_null_removes_a_member() -> None:
    patch = _write("update", "merge_patch", {"severity": None, "routing": {"tier": 2}})
    assert proposed_document(patch, CURRENT) == {
        "channels": ["email"],
        "routing": {"team": "a", "tier": 2},
    }
    assert CURRENT["severity"] == "high"  # the current document is not modified
    replace = _write("update", "replace", {"channels": []})
    assert proposed_document(replace, CURRENT) == {"channels": []}


def test_the_inbox_shows_a_pending_delete_as_every_field_removed(
    people: People, world: World
) -> None:
    Action.objects.filter(pk=world.action.pk).update(
        operation="delete", payload_format="delete", payload=None
    )
    html = client_for(people.operator).get("/approvals/").content.decode()
    for field in ("/channels", "/severity", "/oncall"):
        assert f'<li class="removed"><code>{field}</code>' in html
    assert "<code>/</code>" not in html
