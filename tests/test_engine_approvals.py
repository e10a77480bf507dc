"""Per-run and per-call approvals: quorum, separation of duties, reject, expiry, version binding."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, Approval, ApprovalDecision, Run
from approvals.services.decisions import approval_decide, approval_expire_due
from approvals.services.execution import action_execute
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import Forbidden, InvalidTransition, ValidationFailed
from ownership.models import ConflictClass, Resource, ResourceVersion
from tests.fixtures.engine import reject

pytestmark = pytest.mark.django_db


def _propose_replace(world: Any, kind: Any, doc: dict[str, Any], version: int = 1) -> Action:
    return world.propose(kind, "prod-alerts", payload=doc, observed_version=version)


def test_a_per_call_action_waits_for_approval_then_is_applied(
    engine_world: Any, policy: Any
) -> None:
    action = _propose_replace(engine_world, policy, {"destinations": ["oncall", "backup"]})
    assert action.status == "pending_approval"
    approval = Approval.objects.get(action=action)
    assert approval.observed_version == "1" and approval.quorum == 1

    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    action.refresh_from_db()
    assert action.status == "queued"
    assert action_execute(action_id=action.pk) == "applied"

    action.refresh_from_db()
    assert action.status == "applied"
    resource = Resource.objects.get(name="prod-alerts")
    assert resource.version == 2 and resource.document == {"destinations": ["oncall", "backup"]}
    assert (
        AuditEvent.objects.filter(action_id=action.pk, event_type="approval.approved").count() == 1
    )


def test_a_rejected_action_carries_the_comment_for_the_agent(
    engine_world: Any, policy: Any
) -> None:
    action = _propose_replace(engine_world, policy, {"destinations": []})
    approval = Approval.objects.get(action=action)
    reject(approval, engine_world.operator, "removing every destination silences prod")
    action.refresh_from_db()
    assert action.status == "rejected"
    assert action.error["code"] == "rejected"
    assert action.error["comment"] == "removing every destination silences prod"
    assert action_execute(action_id=action.pk) == "skipped:rejected"
    assert Resource.objects.get(name="prod-alerts").version == 1


def test_a_decided_approval_answers_409_and_writes_no_second_audit_row(
    engine_world: Any, policy: Any
) -> None:
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    events = AuditEvent.objects.count()
    with pytest.raises(InvalidTransition) as excinfo:
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(engine_world.operator2), decision="reject"
        )
    assert excinfo.value.code == "already_decided"
    assert AuditEvent.objects.count() == events


def test_pending_approvals_expire_and_their_action_with_them(
    engine_world: Any, policy: Any
) -> None:
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    assert approval.expires_at > timezone.now() + timedelta(hours=47)

    assert approval_expire_due()["expired"] == 0
    result = approval_expire_due(now=timezone.now() + timedelta(hours=49))
    assert result["expired"] == 1
    approval.refresh_from_db()
    action.refresh_from_db()
    assert approval.status == "expired" and action.status == "expired"
    assert action.error["code"] == "approval_expired"
    assert approval_expire_due(now=timezone.now() + timedelta(hours=50))["expired"] == 0
    with pytest.raises(InvalidTransition):
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
        )


def test_deciding_after_the_deadline_expires_it_instead(engine_world: Any, policy: Any) -> None:
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    Approval.objects.filter(action=action).update(expires_at=timezone.now() - timedelta(seconds=1))
    approval = Approval.objects.get(action=action)
    with pytest.raises(InvalidTransition) as excinfo:
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
        )
    assert excinfo.value.code == "approval_expired"
    action.refresh_from_db()
    assert action.status == "expired"


def test_an_approval_pending_past_the_escalation_time_is_escalated_once(
    engine_world: Any, policy: Any
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(
        escalation_seconds=60, escalation_group="owners"
    )
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    later = timezone.now() + timedelta(seconds=61)
    assert approval_expire_due(now=later)["escalated"] == 1
    assert approval_expire_due(now=later)["escalated"] == 0
    event = AuditEvent.objects.get(event_type="approval.escalated", action_id=action.pk)
    assert event.details["escalation_group"] == "owners"
    # the escalation group now sees it in its list
    from approvals.selectors import approval_list_for_person

    owner = engine_world.person("oscar", "owners")
    assert [a.action_id for a in approval_list_for_person(owner)] == [action.pk]
    assert list(approval_list_for_person(engine_world.outsider)) == []


def test_quorum_of_two_needs_two_distinct_people(engine_world: Any, policy: Any) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    assert approval.quorum == 2

    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    approval.refresh_from_db()
    action.refresh_from_db()
    assert approval.status == "pending" and action.status == "pending_approval"

    with pytest.raises(InvalidTransition) as excinfo:
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
        )
    assert excinfo.value.code == "already_decided"
    assert ApprovalDecision.objects.filter(approval=approval).count() == 1

    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator2), decision="approve"
    )
    approval.refresh_from_db()
    action.refresh_from_db()
    assert approval.status == "approved" and action.status == "queued"


def test_a_vote_below_quorum_moves_the_actions_etag(engine_world: Any, policy: Any) -> None:
    # The body shows the votes so far: a 304 on the old ETag would hide the first vote.
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    before = action.revision

    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    action.refresh_from_db()
    assert action.status == "pending_approval"
    assert action.revision == before + 1


def test_one_reject_ends_a_quorum_approval(engine_world: Any, policy: Any) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(quorum=2)
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    reject(approval, engine_world.operator2, "no")
    action.refresh_from_db()
    assert action.status == "rejected"


def test_the_agents_owner_cannot_approve_where_the_class_forbids_it(
    engine_world: Any, policy: Any
) -> None:
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    with pytest.raises(Forbidden) as excinfo:
        approval_decide(
            approval_id=approval.pk,
            actor=Actor.person(engine_world.agent_owner),
            decision="approve",
        )
    assert excinfo.value.code == "self_approval"
    assert ApprovalDecision.objects.count() == 0


def test_the_agents_owner_may_approve_where_the_class_allows_it(
    engine_world: Any, policy: Any
) -> None:
    ConflictClass.objects.filter(slug="replace_shared_document").update(
        forbid_agent_owner_approval=False
    )
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.agent_owner), decision="approve"
    )
    action.refresh_from_db()
    assert action.status == "queued"


def test_a_person_without_the_operator_role_cannot_decide(engine_world: Any, policy: Any) -> None:
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    for person in (engine_world.outsider, engine_world.person("oscar", "owners")):
        with pytest.raises(Forbidden) as excinfo:
            approval_decide(approval_id=approval.pk, actor=Actor.person(person), decision="approve")
        assert excinfo.value.code == "forbidden"


def test_an_agent_or_run_can_never_decide(engine_world: Any, policy: Any) -> None:
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    for principal in (Actor.agent(engine_world.agent), Actor.run(engine_world.run)):
        with pytest.raises(Forbidden):
            approval_decide(approval_id=approval.pk, actor=principal, decision="approve")


def test_a_bad_decision_is_a_validation_error(engine_world: Any, policy: Any) -> None:
    action = _propose_replace(engine_world, policy, {"severity": "low"})
    approval = Approval.objects.get(action=action)
    with pytest.raises(ValidationFailed):
        approval_decide(
            approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="maybe"
        )


def test_an_approval_is_bound_to_the_version_it_was_given_against(
    engine_world: Any, policy: Any
) -> None:
    action = _propose_replace(engine_world, policy, {"destinations": ["oncall", "backup"]})
    approval = Approval.objects.get(action=action)
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )

    # Another run writes first (a per-run class, queued straight away).
    kind = policy
    kind.class_update_id = "recompute_field"
    kind.save()
    other = engine_world.propose(
        kind,
        "prod-alerts",
        payload={"severity": "critical"},
        payload_format="merge_patch",
        observed_version=1,
        run=engine_world.other_run,
    )
    assert action_execute(action_id=other.pk) == "applied"

    assert action_execute(action_id=action.pk) == "conflict"
    action.refresh_from_db()
    assert action.status == "conflict"
    assert action.error["expected_etag"] == '"1"' and action.error["current_etag"] == '"2"'
    assert action.error["conflict_id"]
    # the approval is never reused: the action is final and nothing more is written
    assert action_execute(action_id=action.pk) == "skipped:conflict"
    assert ResourceVersion.objects.filter(resource__name="prod-alerts").count() == 2
    assert Resource.objects.get(name="prod-alerts").document == {
        "destinations": ["oncall"],
        "severity": "critical",
    }


def test_a_run_approval_activates_the_run_and_a_rejection_rejects_it(
    engine_world: Any, policy: Any
) -> None:
    from django.db import transaction

    from approvals.services.approval_open import approval_open_for_run

    def make(task: str) -> Run:
        with transaction.atomic():
            run = Run.objects.create(
                agent=engine_world.agent,
                task=task,
                write_set=[
                    {"resource": "notification-policy/prod-alerts", "operations": ["update"]}
                ],
                status="pending_approval",
                token_prefix="rt_x",
                token_hash=task.ljust(64, "0"),
                expires_at=timezone.now() + timedelta(hours=1),
                max_expires_at=timezone.now() + timedelta(hours=2),
            )
            approval_open_for_run(run=run)
        return run

    Run.objects.filter(pk=engine_world.run.pk).update(status="finished")
    first = make("first")
    approval = Approval.objects.get(run=first, subject="run")
    # the agent's owner is kept out: the run's write set falls in a class that forbids it
    with pytest.raises(Forbidden):
        approval_decide(
            approval_id=approval.pk,
            actor=Actor.person(engine_world.agent_owner),
            decision="approve",
        )
    approval_decide(
        approval_id=approval.pk, actor=Actor.person(engine_world.operator), decision="approve"
    )
    first.refresh_from_db()
    assert first.status == "active"

    second = make("second")
    approval = Approval.objects.get(run=second, subject="run")
    reject(approval, engine_world.operator, "scope")
    second.refresh_from_db()
    assert second.status == "rejected"
