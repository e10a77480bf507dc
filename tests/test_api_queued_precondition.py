"""Hot resource: a proposal that a write already queued on the resource will supersede
is refused at once (412 naming `queued_action`), not recorded to become a conflict at
execution. Pending approvals do not count (they may never run); collisions that can
still happen (two approvals on one version) are still caught at execution."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from approvals.models import Action, Approval
from approvals.services.actions import Proposal, action_propose
from approvals.services.decisions import approval_decide
from approvals.services.execution import action_execute
from approvals.services.preconditions import parse_write_if_match
from approvals.services.queued_writes import lock_resource_for_proposal
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.errors import DomainError
from ownership.models import Resource, ResourceKind
from tests.fixtures.core import make_action, make_resource
from tests.races import (
    WAIT,
    Holder,
    Worker,
    wait_for_lock_waiters,
    wait_until_blocked_or_finished,
)

DNS = "/api/v1/resources/dns-record/app-hot"
PROD = "/api/v1/resources/notification-policy/prod-alerts"


def body(response: Any) -> Any:
    return json.loads(response.content)


def patch(api: Any, run: Any, path: str, etag: str, key: str, value: int) -> Any:
    return api.patch(
        path,
        token=run.token,
        body={"counter": value},
        headers={"If-Match": etag, "Idempotency-Key": key},
    )


@pytest.mark.django_db
def test_it_refuses_a_proposal_on_the_version_a_queued_write_will_replace(
    api: Any, run: Any
) -> None:
    make_resource("dns-record/app-hot", {"counter": 0}, version=3)
    first = patch(api, run, DNS, '"3"', "key-hot-first", 1)
    assert first.status_code == 202 and body(first)["status"] == "queued"
    second = patch(api, run, DNS, '"3"', "key-hot-second", 1)
    assert second.status_code == 412, second.content
    problem = body(second)
    assert problem["code"] == "stale_version" and problem["retryable"] is False
    assert problem["expected_etag"] == problem["current_etag"] == '"3"'
    assert problem["resource"] == "dns-record/app-hot"
    assert problem["conflict_class"] == "recompute_field" and problem["resolver"] == "agent"
    first_id = body(first)["id"]
    assert problem["queued_action"] == {"id": first_id, "url": f"/api/v1/actions/{first_id}"}
    assert Action.objects.filter(name="app-hot").count() == 1
    refused = AuditEvent.objects.get(event_type="action.refused_stale")
    assert refused.details["queued_action"] == first_id
    assert refused.details["expected_etag"] == '"3"'
    # Recorded like any 412: the same key replays the same answer.
    replay = patch(api, run, DNS, '"3"', "key-hot-second", 1)
    assert replay.status_code == 412 and replay["Idempotent-Replayed"] == "true"
    assert body(replay)["queued_action"] == problem["queued_action"]
    assert AuditEvent.objects.filter(event_type="action.refused_stale").count() == 1


@pytest.mark.django_db
def test_it_refuses_a_create_while_another_create_of_the_name_is_queued(api: Any, run: Any) -> None:
    path = "/api/v1/resources/dns-record/app-new"
    headers = {"If-None-Match": "*"}
    first = api.put(
        path,
        token=run.token,
        body={"ip": "10.0.0.1"},
        headers={**headers, "Idempotency-Key": "key-create-1"},
    )
    assert first.status_code == 202 and body(first)["status"] == "queued"
    second = api.put(
        path,
        token=run.token,
        body={"ip": "10.0.0.2"},
        headers={**headers, "Idempotency-Key": "key-create-2"},
    )
    assert second.status_code == 412, second.content
    problem = body(second)
    assert problem["expected_etag"] is None and problem["current_etag"] is None
    assert problem["queued_action"]["id"] == body(first)["id"]
    assert Action.objects.filter(name="app-new").count() == 1


@pytest.mark.django_db
def test_a_queued_write_on_an_older_version_does_not_refuse_a_current_one(
    api: Any, run: Any
) -> None:
    # Based on version 2, it will be a conflict itself: it supersedes nothing.
    make_resource("dns-record/app-hot", {"counter": 0}, version=3)
    make_action(run=run.run, identifier="dns-record/app-hot", observed_version=2)
    accepted = patch(api, run, DNS, '"3"', "key-hot-current", 1)
    assert accepted.status_code == 202, accepted.content


@pytest.mark.django_db
def test_once_the_queued_write_is_cancelled_the_same_version_is_accepted(
    api: Any, run: Any
) -> None:
    make_resource("dns-record/app-hot", {"counter": 0}, version=3)
    first = body(patch(api, run, DNS, '"3"', "key-hot-a", 1))
    cancelled = api.post(f"/api/v1/actions/{first['id']}/cancel", token=run.token)
    assert cancelled.status_code == 200, cancelled.content
    again = patch(api, run, DNS, '"3"', "key-hot-b", 1)
    assert again.status_code == 202, again.content


@pytest.mark.django_db
def test_writes_pending_approval_on_one_version_are_accepted_and_collide_at_execution(
    api: Any, run: Any, prod_alerts: Any, operator: Any, engine_redis: Any
) -> None:
    # A pending approval may never run, so it refuses nothing; once both are approved
    # the collision can only be caught where it always was: at execution.
    first = body(patch(api, run, PROD, '"41"', "key-pend-1", 1))
    second = body(patch(api, run, PROD, '"41"', "key-pend-2", 2))
    assert first["status"] == second["status"] == "pending_approval"
    for action in (first, second):
        approval_decide(
            approval_id=Approval.objects.get(action_id=action["id"]).pk,
            actor=Actor.person(operator.user),
            decision="approve",
        )
    assert action_execute(action_id=first["id"]) == "applied"
    assert action_execute(action_id=second["id"]) == "conflict"
    assert Resource.objects.get(name="prod-alerts").document["counter"] == 1
    # While the first was queued, a third proposal on "41" would have been refused;
    # now "41" is simply stale (the first applied).
    third = patch(api, run, PROD, '"41"', "key-pend-3", 3)
    assert third.status_code == 412 and "queued_action" not in body(third)


def _proposal(kind: ResourceKind, key: str, if_match: str = '"3"') -> Proposal:
    return Proposal(
        kind=kind,
        name="app-race",
        operation="update",
        payload_format="merge_patch",
        payload={"counter": 1},
        if_match=parse_write_if_match(if_match),
        create_if_absent=False,
        idempotency_key=key,
        reason="",
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
def test_two_proposals_on_one_version_racing_record_exactly_one(run: Any) -> None:
    make_resource("dns-record/app-race", {"counter": 0}, version=3)
    kind = ResourceKind.objects.get(slug="dns-record")
    recorded, release = threading.Event(), threading.Event()

    def hold_open(action: Action) -> None:  # inside the first proposal's transaction
        recorded.set()
        assert release.wait(WAIT), "never released"

    first = Worker(
        lambda: action_propose(
            run=run.run, proposal=_proposal(kind, "key-race-1"), on_recorded=hold_open
        )
    )
    first.start()
    assert recorded.wait(WAIT), "the first proposal was never recorded"
    second = Worker(lambda: action_propose(run=run.run, proposal=_proposal(kind, "key-race-2")))
    second.start()
    # The second waits on the resource's proposal lock (or, without it, finishes).
    wait_until_blocked_or_finished(second)
    release.set()
    winner = first.finish()
    with pytest.raises(DomainError) as refused:
        second.finish()
    assert refused.value.code == "stale_version"
    assert refused.value.extra["queued_action"]["id"] == str(winner.pk)
    assert list(Action.objects.filter(name="app-race").values_list("pk", flat=True)) == [winner.pk]


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(90)
def test_a_stale_proposal_is_refused_at_once_while_another_holds_the_resources_lock(
    run: Any,
) -> None:
    """The losers on a hot resource learn they lost without queueing for its proposal lock
    (where each refusal took a commit and the next winner waited behind them all); a
    proposal on the current version still waits its turn."""
    make_resource("dns-record/app-race", {"counter": 0}, version=3)
    kind = ResourceKind.objects.get(slug="dns-record")
    holder = Holder(lambda: lock_resource_for_proposal("dns-record", "app-race")).hold()
    try:
        stale = Worker(
            lambda: action_propose(
                run=run.run, proposal=_proposal(kind, "key-stale", if_match='"2"')
            )
        )
        stale.start()
        stale.join(WAIT)
        assert not stale.is_alive(), "the stale proposal waited for the resource's lock"
        with pytest.raises(DomainError) as refused:
            stale.finish()
        assert refused.value.code == "stale_version"
        assert refused.value.extra["current_etag"] == '"3"'
        audited = AuditEvent.objects.filter(event_type="action.refused_stale")
        assert [e.details["idempotency_key"] for e in audited] == ["key-stale"]
        current = Worker(lambda: action_propose(run=run.run, proposal=_proposal(kind, "key-now")))
        current.start()
        wait_for_lock_waiters(1, threads=(current,))
    finally:
        holder.release()
    assert current.finish().observed_version == "3"
    assert Action.objects.filter(name="app-race").count() == 1


@pytest.mark.django_db
def test_a_read_names_the_write_queued_over_its_version_until_it_is_final(
    api: Any, run: Any
) -> None:
    make_resource("dns-record/app-hot", {"counter": 0}, version=3)
    assert "Airlock-Queued-Action" not in api.get(DNS, token=run.token)
    first = body(patch(api, run, DNS, '"3"', "key-read-first", 1))
    read = api.get(DNS, token=run.token)
    assert read.status_code == 200 and read["Airlock-Queued-Action"] == first["id"]
    unchanged = api.get(DNS, token=run.token, headers={"If-None-Match": '"3"'})
    assert unchanged.status_code == 304 and unchanged["Airlock-Queued-Action"] == first["id"]
    Action.objects.filter(pk=first["id"]).update(status="applied")
    assert "Airlock-Queued-Action" not in api.get(DNS, token=run.token)
