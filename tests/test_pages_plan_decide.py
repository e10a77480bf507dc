"""A plan approved or rejected from its own page (/plans/{id}/decide/): the inbox's
decision service (CSRF, separation of duties, quorum), answered in place for htmx and
with a notice on the plan page without JavaScript."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client

from approvals.models import Approval, Plan, Run
from audit.models import AuditEvent
from tests.fixtures.console import client_for
from tests.fixtures.core import make_resource
from tests.test_pages_plans import POLICY, _csrf_client, _plan_approval, _propose, _steps

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def plan(api: Any, run: Any, db: Any) -> Plan:
    """The plan page tests' plan (tests/test_pages_plans.py): three steps, waiting."""
    make_resource("dns-record/app-a", {"ip": "1", "ttl": 60}, version=3)
    make_resource("dns-record/app-c", {"ip": "c"}, version=5)
    make_resource(POLICY, {"channels": ["email"]}, version=41)
    return _propose(api, run, _steps())


def _page_token(client: Client, plan: Plan) -> str:
    html = client.get(f"/plans/{plan.id}/").content.decode()
    start = html.index('id="plan-decision-form"')
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html[start:])
    assert match, "the plan page's decision form carries a CSRF token"
    return match.group(1)


def test_an_operator_approves_a_plan_on_its_page_in_place(plan: Plan, operator: Any) -> None:
    approval = _plan_approval(plan)
    client = _csrf_client(operator.user)
    url = f"/plans/{plan.id}/decide/"
    refused = client.post(url, {"decision": "approve"}, headers={"HX-Request": "true"})
    assert refused.status_code == 403  # no CSRF token
    assert Approval.objects.get(pk=approval.pk).status == "pending"

    token = _page_token(client, plan)
    response = client.post(
        url,
        {"decision": "approve", "comment": "looks right", "csrfmiddlewaretoken": token},
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 200, response.content
    body = response.content.decode()
    assert body.lstrip().startswith('<div id="plan-live"') and "<html" not in body
    assert 'id="plan-my-decision"' in body and "You approved this plan" in body
    assert 'id="plan-decision-form"' not in body  # decided: no second form
    assert set(json.loads(response["HX-Trigger"])) == {"counts-changed", "approvals-changed"}
    assert Approval.objects.get(pk=approval.pk).status == "approved"
    assert Plan.objects.get(pk=plan.pk).status in ("executing", "applied")
    assert AuditEvent.objects.filter(
        event_type="approval.approved", details__plan=str(plan.pk)
    ).exists()

    again = client.post(
        url, {"decision": "approve", "csrfmiddlewaretoken": token}, headers={"HX-Request": "true"}
    )
    assert again.status_code == 409
    assert 'id="plan-decision-error"' in again.content.decode()
    # An error stops the page's own poll (the message would vanish a second later).
    assert 'hx-trigger="every 1s"' not in again.content.decode()


def test_a_rejection_without_javascript_needs_a_comment_and_lands_on_the_plan_page(
    plan: Plan, operator: Any
) -> None:
    client = _csrf_client(operator.user)
    token = _page_token(client, plan)
    url = f"/plans/{plan.id}/decide/"
    empty = client.post(url, {"decision": "reject", "comment": " ", "csrfmiddlewaretoken": token})
    assert empty.status_code == 302 and empty["Location"] == f"/plans/{plan.id}/"
    assert Plan.objects.get(pk=plan.pk).status == "pending_approval"
    page = client.get(f"/plans/{plan.id}/").content.decode()
    assert "Say why you reject" in page  # the notice shows on the page of the action

    response = client.post(
        url, {"decision": "reject", "comment": "freeze", "csrfmiddlewaretoken": token}
    )
    assert response.status_code == 302 and response["Location"] == f"/plans/{plan.id}/"
    assert Plan.objects.get(pk=plan.pk).status == "rejected"
    page = client.get(f"/plans/{plan.id}/").content.decode()
    assert "Your decision on the plan is recorded." in page and "You rejected this plan" in page


def test_the_runs_token_minter_gets_no_form_and_is_refused(
    plan: Plan, operator: Any, admin: Any
) -> None:
    Run.objects.filter(pk=plan.run_id).update(token_minted_by=operator.user)
    client = _csrf_client(operator.user)
    page = client.get(f"/plans/{plan.id}/").content.decode()
    assert 'id="plan-decision-form"' not in page and "Separation of duties" in page
    # Posting anyway (a form from another tab): the service refuses, nothing changes.
    token = _page_token(_csrf_client(admin.user), plan)
    forced = client_for(operator.user).post(
        f"/plans/{plan.id}/decide/",
        {"decision": "approve", "csrfmiddlewaretoken": token},
        headers={"HX-Request": "true"},
    )
    assert forced.status_code == 403, forced.content
    assert 'id="plan-decision-error"' in forced.content.decode()
    assert Plan.objects.get(pk=plan.pk).status == "pending_approval"


def test_a_quorum_of_two_needs_two_people(plan: Plan, operator: Any, admin: Any) -> None:
    approval = _plan_approval(plan)
    Approval.objects.filter(pk=approval.pk).update(quorum=2)
    first = _csrf_client(operator.user)
    response = first.post(
        f"/plans/{plan.id}/decide/",
        {"decision": "approve", "csrfmiddlewaretoken": _page_token(first, plan)},
        headers={"HX-Request": "true"},
    )
    body = response.content.decode()
    assert response.status_code == 200
    assert "You approved this plan" in body and "it needs 2 approvals in all" in body
    assert 'id="plan-decision-form"' not in body
    assert Approval.objects.get(pk=approval.pk).status == "pending"
    second = _csrf_client(admin.user)
    assert 'id="plan-decision-form"' in second.get(f"/plans/{plan.id}/").content.decode()
    second.post(
        f"/plans/{plan.id}/decide/",
        {"decision": "approve", "csrfmiddlewaretoken": _page_token(second, plan)},
        headers={"HX-Request": "true"},
    )
    assert Approval.objects.get(pk=approval.pk).status == "approved"


def test_someone_who_may_not_read_the_plan_gets_404(plan: Plan, outsider: Any) -> None:
    response = client_for(outsider.user).post(f"/plans/{plan.id}/decide/", {"decision": "approve"})
    assert response.status_code == 404
    assert Plan.objects.get(pk=plan.pk).status == "pending_approval"
