"""The console side of plans (issue 13): the plan page, the plan approval card in the
inbox, the run/action/audit links.

Plans are proposed through the real API with a run token (the write set covers
`notification-policy/prod-alerts`, per-call, and `dns-record/app-*`, per-run); a
per-call step makes the plan wait for one approval. Tests that watch a plan
execute use a real `rqworker` process.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from django.test import Client

from approvals.models import Approval, Plan, PlanStep
from audit.models import AuditEvent
from ownership.models import Resource, ResourceVersion
from tests.fixtures.console import client_for
from tests.fixtures.core import make_resource
from tests.fixtures.engine import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

POLICY = "notification-policy/prod-alerts"


@pytest.fixture
def documents(db: Any) -> dict[str, Any]:
    return {
        "app_a": make_resource("dns-record/app-a", {"ip": "1", "ttl": 60}, version=3),
        "app_c": make_resource("dns-record/app-c", {"ip": "c"}, version=5),
        "policy": make_resource(POLICY, {"channels": ["email"]}, version=41),
    }


def _steps() -> list[dict[str, Any]]:
    """app-a (patch, undo by default), app-new (create, agent's own compensation),
    the policy (per-call: the plan waits for a person)."""
    return [
        {"resource": "dns-record/app-a", "method": "PATCH", "if_match": '"3"',
         "patch": {"ip": "2"}},
        {"resource": "dns-record/app-new", "method": "PUT", "if_none_match": "*",
         "document": {"ip": "9"}, "compensation": {"method": "PUT", "document": {"ip": "0"}}},
        {"resource": POLICY, "method": "PATCH", "if_match": '"41"',
         "patch": {"channels": ["pager"]}},
    ]  # fmt: skip


def _propose(api: Any, run: Any, steps: list[dict[str, Any]]) -> Plan:
    response = api.post(
        f"/api/v1/runs/{run.run.pk}/plans",
        token=run.token,
        body={"reason": "move app-a and its alerts together", "steps": steps},
        headers={"Idempotency-Key": f"plan-{uuid.uuid4().hex}"},
    )
    assert response.status_code == 202, response.content
    return Plan.objects.get(pk=response.json()["id"])


@pytest.fixture
def plan(api: Any, run: Any, documents: Any) -> Plan:
    """`run`'s plan of the three _steps, waiting for its approval."""
    return _propose(api, run, _steps())


def _card(html: str, approval: Approval) -> str:
    start = html.index(f'id="approval-{approval.id}"')
    return html[start : html.index("</article>", start)]


def _plan_approval(plan: Plan) -> Approval:
    return Approval.objects.get(plan=plan, subject="plan")


def test_the_inbox_shows_a_plan_as_one_card_with_every_step_its_diff_and_compensation(
    plan: Plan, operator: Any
) -> None:
    approval = _plan_approval(plan)
    html = client_for(operator.user).get("/approvals/").content.decode()
    card = _card(html, approval)
    assert "Plan approval: 3 writes by <code>deploy-bot</code>, approved as one" in card
    assert f'href="/plans/{plan.id}/"' in card and "move app-a and its alerts together" in card
    # Every step, in order, with its diff against the document now.
    positions = [card.index(f"Step {n}: ") for n in (1, 2, 3)]
    assert positions == sorted(positions)
    assert "Step 1: update <code>dns-record/app-a</code>" in card
    assert (
        "<code>/ip</code>" in card
        and 'removed: </span><span class="mark" aria-hidden="true">\u2212</span>&quot;1&quot;</del>'
        in card
        and 'added: </span><span class="mark" aria-hidden="true">+</span>&quot;2&quot;</ins>'
        in card
    )
    assert "/ttl" not in card  # an unchanged field is not in the diff
    assert "Step 2: create <code>dns-record/app-new</code>" in card and "(new)" in card
    assert (
        '<span class="tag tag-added">added</span> <ins>'
        '<span class="mark" aria-hidden="true">+</span>&quot;9&quot;' in card
    )
    assert "Step 3: update <code>notification-policy/prod-alerts</code>" in card
    assert "&quot;pager&quot;" in card and "replace_shared_document" in card
    # Each step's compensation: the default undo, or the agent's own write.
    assert card.count("undo (back to the document before this step)") == 2
    assert "PUT <code>{&quot;ip&quot;: &quot;0&quot;}</code>" in card
    # ... and what each compensation leaves, as a diff against the version observed.
    assert card.count('class="compensation-diff"') == 3
    assert 'data-compensation-method="PUT"' in card and "class <code>recompute_field</code>" in card
    # The approval's quorum (the strictest class's) and one form for the whole plan.
    assert f"0 of {approval.quorum} approval" in card
    assert card.count('name="decision" value="approve"') == 1
    assert html.count(f'action="/approvals/{approval.id}/decision/"') == 1


def test_a_step_whose_resource_moved_is_flagged_on_the_card(
    plan: Plan, operator: Any, documents: Any
) -> None:
    Resource.objects.filter(pk=documents["app_a"].pk).update(version=4)
    card = _card(
        client_for(operator.user).get("/approvals/").content.decode(), _plan_approval(plan)
    )
    assert "The resource changed since the agent read it (observed 3, now 4)" in card


def _csrf_client(user: Any) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def _csrf_token(html: str, approval: Approval) -> str:
    card = _card(html, approval)
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', card)
    assert match, "the decision form carries a CSRF token"
    return match.group(1)


def test_an_operator_approves_a_plan_with_the_card_form_and_gets_the_card_back(
    plan: Plan, operator: Any
) -> None:
    approval = _plan_approval(plan)
    client = _csrf_client(operator.user)
    url = f"/approvals/{approval.id}/decision/"
    # Without the CSRF token the decision is refused and nothing changes.
    refused = client.post(
        url, {"decision": "approve", "comment": ""}, headers={"HX-Request": "true"}
    )
    assert refused.status_code == 403
    assert Approval.objects.get(pk=approval.pk).status == "pending"

    token = _csrf_token(client.get("/approvals/").content.decode(), approval)
    response = client.post(
        url,
        {"decision": "approve", "comment": "one change", "csrfmiddlewaretoken": token},
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 200, response.content
    fragment = response.content.decode()
    assert "<html" not in fragment
    assert f'id="approval-{approval.id}"' in fragment and "Plan approval: 3 writes" in fragment
    assert "Decided at" in fragment and "olga" not in fragment
    assert "ana (approve: “one change”)" in fragment
    assert set(json.loads(response["HX-Trigger"])) == {"counts-changed", "approvals-changed"}
    assert Approval.objects.get(pk=approval.pk).status == "approved"
    assert Plan.objects.get(pk=plan.pk).status in ("executing", "applied")

    # Deciding again changes nothing: the card says why, no second audit row.
    again = client.post(
        url,
        {"decision": "approve", "comment": "", "csrfmiddlewaretoken": token},
        headers={"HX-Request": "true"},
    )
    assert again.status_code == 409, again.content
    assert 'class="error"' in again.content.decode()
    approved = AuditEvent.objects.filter(event_type="approval.approved", details__plan=str(plan.pk))
    assert approved.count() == 1


def test_a_rejection_through_the_plain_form_ends_the_plan(plan: Plan, operator: Any) -> None:
    approval = _plan_approval(plan)
    client = _csrf_client(operator.user)
    token = _csrf_token(client.get("/approvals/").content.decode(), approval)
    response = client.post(
        f"/approvals/{approval.id}/decision/",
        {"decision": "reject", "comment": "not during the freeze", "csrfmiddlewaretoken": token},
    )
    assert response.status_code == 302 and response["Location"] == "/approvals/"
    assert Plan.objects.get(pk=plan.pk).status == "rejected"
    html = client.get(f"/plans/{plan.id}/").content.decode()
    assert 'data-status="rejected"' in html and "not during the freeze" in html
    assert 'hx-get="/plans/' not in html  # final: nothing polls


def test_the_plan_page_is_404_for_someone_who_may_not_read_it(
    plan: Plan, operator: Any, outsider: Any, owner: Any
) -> None:
    assert client_for(outsider.user).get(f"/plans/{plan.id}/").status_code == 404
    # The owners of a resource the plan will write see it before any step ran.
    assert client_for(owner.user).get(f"/plans/{plan.id}/").status_code == 200
    assert client_for(operator.user).get(f"/plans/{uuid.uuid4()}/").status_code == 404
    assert client_for(operator.user).get(f"/plans/{plan.id}/").status_code == 200
    assert Client().get(f"/plans/{plan.id}/").status_code == 302  # sign in first


def test_a_pending_plan_page_shows_its_approval_and_polls_its_live_part(
    plan: Plan, run: Any, operator: Any
) -> None:
    approval = _plan_approval(plan)
    client = client_for(operator.user)
    html = client.get(f"/plans/{plan.id}/").content.decode()
    assert 'id="plan-status" data-status="pending_approval"' in html
    assert f'href="/runs/{run.run.pk}/"' in html and "deploy-bot" in html
    assert "move app-a and its alerts together" in html
    assert f"0 of {approval.quorum} approval" in html and "none yet" in html
    assert f'href="/approvals/#approval-{approval.id}"' in html
    assert html.count('class="plan-step"') == 3 and html.count('data-status="pending"') == 3
    assert "What it changes (version 3 the agent observed → result of this step)" in html
    assert "What it changes (nothing yet → result of this step)" in html
    assert f'hx-get="/plans/{plan.id}/"' in html
    fragment = client.get(f"/plans/{plan.id}/", headers={"HX-Request": "true"})
    assert fragment.status_code == 200  # not final: keep polling
    body = fragment.content.decode()
    assert "<html" not in body and body.lstrip().startswith('<div id="plan-live"')
    assert "HX-Request" in fragment["Vary"]


@pytest.mark.slow
def test_a_compensated_plan_shows_every_step_state_and_links_run_action_and_audit(
    api: Any, run: Any, operator: Any, documents: Any, rq_worker: Any
) -> None:
    """Step 4 is refused as stale (app-c moved while the plan waited for its
    approval): steps 3, 2, 1 are compensated in reverse; the page shows it all."""
    worker = rq_worker()
    steps = [
        *_steps(),
        {"resource": "dns-record/app-c", "method": "PUT", "if_match": '"5"',
         "document": {"ip": "c2"}},
    ]  # fmt: skip
    plan = _propose(api, run, steps)
    app_c = documents["app_c"]
    Resource.objects.filter(pk=app_c.pk).update(document={"ip": "someone"}, version=6)
    ResourceVersion.objects.create(
        resource=app_c, version=6, document={"ip": "someone"}, operation="seed"
    )
    client = client_for(operator.user)
    approval = _plan_approval(plan)
    decided = client.post(f"/approvals/{approval.id}/decision/", {"decision": "approve"})
    assert decided.status_code == 302
    try:
        wait_for(lambda: Plan.objects.get(pk=plan.pk).status == "compensated", timeout=40)
    except AssertionError:
        print(worker.output()[-4000:])
        raise

    html = client.get(f"/plans/{plan.id}/").content.decode()
    assert 'id="plan-status" data-status="compensated"' in html
    states = re.findall(r'<h3>Step \d+: .*?data-status="(\w+)"', html)
    assert states == ["applied", "applied", "applied", "refused"]
    assert html.count('data-compensation="compensated"') == 3
    assert "stale_version" in html  # the refusal and why the plan stopped
    step_rows = PlanStep.objects.filter(plan=plan).select_related(
        "applied_operation", "compensation_operation"
    )
    for step in step_rows:
        assert f'href="/actions/{step.action_id}/"' in html
        if step.applied_operation is not None:
            op = step.applied_operation
            assert f"operation #{op.pk}, fence {op.fence}" in html
            assert f"undo operation #{step.compensation_operation.pk}" in html
    # An applied step shows what it changed, version to version.
    assert "What it changed (version 3 → 4)" in html
    assert "1 of 1 approval" in html and "ana (approve)" in html
    # A final plan: the live part stops polling (htmx 286) and carries no poller.
    assert 'hx-get="/plans/' not in html
    assert client.get(f"/plans/{plan.id}/", headers={"HX-Request": "true"}).status_code == 286

    # The run page lists the plan; a step's action page names its plan.
    run_html = client.get(f"/runs/{run.run.pk}/").content.decode()
    assert f'href="/plans/{plan.id}/"' in run_html and 'status-compensated">compensated' in run_html
    first = step_rows.get(position=2)
    action_html = client.get(f"/actions/{first.action_id}/").content.decode()
    assert f'step 2 of <a href="/plans/{plan.id}/">plan {str(plan.id)[:8]}</a>' in action_html
    # The audit trail links its plan events to the plan page.
    audit_html = client.get("/audit/?type=plan.proposed").content.decode()
    assert f'<a href="/plans/{plan.id}/">plan {str(plan.id)[:8]}</a>' in audit_html
