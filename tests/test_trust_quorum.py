"""Issue 9, item 5: a quorum set on a per-run class gates the run's approval.

A run's approval needs the highest quorum among the per-run classes its write
set touches, counted in distinct people under the per-call separation-of-duties
rules; an auto-approve rule stands in for one approver, never for a quorum.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from approvals.models import Approval, ApprovalDecision, AutoApproveRule, Run
from approvals.services.decisions import approval_decide
from approvals.services.runs import run_create
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import Forbidden, InvalidTransition
from ownership.models import ConflictClass, OwnershipRecord
from tests.fixtures.api import AgentActor, Person, make_person_with_token
from tests.races import Holder, Worker, wait_for_lock_waiters

pytestmark = pytest.mark.django_db

# dns-record (tests.fixtures.api): create -> add_unique, update/delete -> recompute_field
# (both per run); notification-policy update/delete -> replace_shared_document (per call).
DNS_UPDATE = [{"resource": "dns-record/app-web", "operations": ["update"]}]


def _create(agent: AgentActor, write_set: list[dict[str, Any]]) -> Run:
    run, _ = run_create(
        agent=agent.agent,
        task="quorum test",
        write_set=write_set,
        ttl_seconds=None,
        actor=Actor.agent(agent.agent),
    )
    return run


def _run_approval(run: Run) -> Approval:
    return Approval.objects.get(run=run, subject="run")


def _quorum_two_run(agent: AgentActor) -> tuple[Run, Approval]:
    """A run of DNS_UPDATE whose class (recompute_field) needs two approvals, and its
    pending run approval."""
    ConflictClass.objects.filter(slug="recompute_field").update(quorum=2)
    run = _create(agent, DNS_UPDATE)
    return run, _run_approval(run)


@pytest.fixture
def second_operator(db: Any) -> Person:
    return make_person_with_token("bea", "operators")


def test_one_approval_of_a_quorum_two_run_leaves_it_pending_and_a_second_person_activates_it(
    agent: AgentActor, operator: Person, second_operator: Person
) -> None:
    run, approval = _quorum_two_run(agent)
    assert run.status == "pending_approval" and approval.quorum == 2

    approval_decide(approval_id=approval.pk, actor=Actor.person(operator.user), decision="approve")
    run.refresh_from_db()
    approval.refresh_from_db()
    assert run.status == "pending_approval" and approval.status == "pending"
    assert not OwnershipRecord.objects.filter(run=run).exists()

    approval_decide(
        approval_id=approval.pk, actor=Actor.person(second_operator.user), decision="approve"
    )
    run.refresh_from_db()
    approval.refresh_from_db()
    assert run.status == "active" and approval.status == "approved"
    assert OwnershipRecord.objects.filter(run=run, active=True).count() == 1
    assert AuditEvent.objects.filter(run_id=run.pk, event_type="run.activated").count() == 1


def test_the_same_person_approving_twice_counts_once_and_leaves_the_run_pending(
    agent: AgentActor, operator: Person
) -> None:
    run, approval = _quorum_two_run(agent)
    approval_decide(approval_id=approval.pk, actor=Actor.person(operator.user), decision="approve")
    events = AuditEvent.objects.count()

    with pytest.raises(InvalidTransition) as excinfo:
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(operator.user), decision="approve"
        )

    assert excinfo.value.code == "already_decided"
    assert ApprovalDecision.objects.filter(approval=approval).count() == 1
    assert AuditEvent.objects.count() == events
    run.refresh_from_db()
    assert run.status == "pending_approval"


def test_the_run_quorum_is_the_highest_among_its_per_run_classes_only(
    agent: AgentActor,
) -> None:
    ConflictClass.objects.filter(slug="add_unique").update(quorum=2)
    ConflictClass.objects.filter(slug="recompute_field").update(quorum=3)
    # A per-call class keeps gating each call with its own quorum; it does not
    # raise the run's.
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=5)

    both = _create(agent, [{"resource": "dns-record/app-*", "operations": ["create", "update"]}])
    creates = _create(agent, [{"resource": "dns-record/new-*", "operations": ["create"]}])
    per_call_only = _create(
        agent, [{"resource": "notification-policy/prod-alerts", "operations": ["update"]}]
    )

    assert _run_approval(both).quorum == 3
    assert _run_approval(creates).quorum == 2
    assert _run_approval(per_call_only).quorum == 1
    requested = AuditEvent.objects.get(run_id=both.pk, event_type="approval.requested")
    assert requested.details["quorum"] == 3


def test_an_auto_approve_rule_never_admits_a_run_whose_classes_need_a_quorum(
    agent: AgentActor, operator: Person, second_operator: Person
) -> None:
    AutoApproveRule.objects.create(kind_id="dns-record", name_prefix="", operations=["update"])
    admitted = _create(agent, DNS_UPDATE)
    assert admitted.status == "active" and admitted.auto_approved  # quorum 1: the rule admits

    ConflictClass.objects.filter(slug="recompute_field").update(quorum=2)
    run = _create(agent, [{"resource": "dns-record/app-db", "operations": ["update"]}])

    assert run.status == "pending_approval" and not run.auto_approved
    assert not AuditEvent.objects.filter(run_id=run.pk, event_type="run.auto_approved").exists()
    approval = _run_approval(run)
    assert approval.quorum == 2
    approval_decide(approval_id=approval.pk, actor=Actor.person(operator.user), decision="approve")
    run.refresh_from_db()
    assert run.status == "pending_approval"
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(second_operator.user), decision="approve"
    )
    run.refresh_from_db()
    assert run.status == "active"


def test_the_agents_owner_does_not_count_toward_a_run_quorum(
    agent: AgentActor, operator: Person
) -> None:
    ConflictClass.objects.filter(slug="recompute_field").update(quorum=2)
    agent.agent.owner = make_person_with_token("odin", "operators").user
    agent.agent.save(update_fields=["owner"])
    run = _create(agent, DNS_UPDATE)
    approval = _run_approval(run)
    approval_decide(approval_id=approval.pk, actor=Actor.person(operator.user), decision="approve")

    with pytest.raises(Forbidden) as excinfo:
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(agent.agent.owner), decision="approve"
        )

    assert excinfo.value.code == "self_approval"
    run.refresh_from_db()
    assert run.status == "pending_approval"


def test_the_approvals_list_shows_votes_so_far_against_the_run_quorum(
    api: Any, agent: AgentActor, operator: Person, second_operator: Person
) -> None:
    _, approval = _quorum_two_run(agent)
    approval_decide(approval_id=approval.pk, actor=Actor.person(operator.user), decision="approve")

    listed = json.loads(api.get("/api/v1/approvals", token=second_operator.token).content)
    (item,) = [i for i in listed["items"] if i["id"] == str(approval.pk)]
    assert item["subject"] == "run"
    assert (item["approvals_so_far"], item["quorum"]) == (1, 2)

    approval_decide(
        approval_id=approval.pk, actor=Actor.person(second_operator.user), decision="approve"
    )
    one = json.loads(api.get(f"/api/v1/approvals/{approval.pk}", token=operator.token).content)
    assert (one["approvals_so_far"], one["quorum"], one["status"]) == (2, 2, "approved")


@pytest.mark.django_db(transaction=True)
def test_two_people_voting_at_once_activate_the_run_exactly_once(
    agent: AgentActor, operator: Person, second_operator: Person
) -> None:
    run, approval = _quorum_two_run(agent)

    # Hold the run row so both votes queue behind it, then let them race.
    holder = Holder(
        lambda: list(Run.objects.select_for_update().filter(pk=run.pk).values_list("pk"))
    ).hold()
    start = threading.Barrier(2)

    def vote(person: Person) -> Any:
        start.wait()
        return approval_decide(
            approval_id=approval.pk, actor=Actor.person(person.user), decision="approve"
        )

    voters = [Worker(lambda p=p: vote(p)) for p in (operator, second_operator)]
    for voter in voters:
        voter.start()
    wait_for_lock_waiters(2, threads=tuple(voters))
    holder.release()
    for voter in voters:
        voter.finish()

    run.refresh_from_db()
    approval.refresh_from_db()
    assert run.status == "active" and approval.status == "approved"
    assert ApprovalDecision.objects.filter(approval=approval).count() == 2
    assert AuditEvent.objects.filter(run_id=run.pk, event_type="run.activated").count() == 1
    assert AuditEvent.objects.filter(run_id=run.pk, event_type="approval.approved").count() == 1
    for person in (operator, second_operator):
        assert (
            AuditEvent.objects.filter(
                run_id=run.pk, event_type="approval.decision_approve", actor_id=str(person.user.pk)
            ).count()
            == 1
        )
    assert OwnershipRecord.objects.filter(run=run, active=True).count() == 1


def test_an_action_of_a_quorum_run_reports_the_runs_votes_and_quorum(
    api: Any, agent: AgentActor, operator: Person, second_operator: Person
) -> None:
    ConflictClass.objects.filter(slug="add_unique").update(quorum=2)
    run, run_token = run_create(
        agent=agent.agent,
        task="quorum test",
        write_set=[{"resource": "dns-record/app-*", "operations": ["create"]}],
        ttl_seconds=None,
        actor=Actor.agent(agent.agent),
    )
    approval = _run_approval(run)
    for person in (operator, second_operator):
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(person.user), decision="approve"
        )

    response = api.put(
        "/api/v1/resources/dns-record/app-new",
        token=run_token,
        body={"target": "10.0.0.1"},
        headers={"If-None-Match": "*", "Idempotency-Key": "quorum-create-1"},
    )
    assert response.status_code == 202, response.content
    info = json.loads(response.content)["approval"]
    assert info["mode"] == "per_run" and info["by"] == "ana, bea"
    assert (info["approvals_so_far"], info["quorum"]) == (2, 2)
