"""Review findings fixed in the API area (review-findings.md #1, #2, #3, #10, #11).

Each test fails without its fix. Races are forced with threads and a transaction
held open (the waiting side is observed blocked in pg_stat_activity), never sleeps.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction
from django.test import RequestFactory
from django.utils import timezone

from approvals.models import Action, Operation, Run
from approvals.services import actions, preconditions
from audit.models import AuditEvent
from audit.services import Actor
from ownership.models import OwnershipRecord
from tests.fixtures.api import (
    make_active_run,
    make_agent_with_token,
    make_person_with_token,
    problem,
)
from tests.fixtures.core import applied_prod_alerts_action, make_action
from tests.races import WAIT, Holder, Worker, finish_each, wait_until_blocked_or_finished

PROD = "/api/v1/resources/notification-policy/prod-alerts"


def patch_prod(api: Any, token: str, key: str = "key-review-0001", etag: str = '"41"') -> Any:
    return api.patch(
        PROD,
        token=token,
        body={"severity": "critical"},
        headers={"If-Match": etag, "Idempotency-Key": key},
    )


# -- finding 1: a run token dies with its run -----------------------------------------


def _end_run(how: str, run: Any, operator: Any) -> None:
    from approvals.services import runs

    if how == "revoked":
        runs.run_revoke(run=run.run, actor=Actor.person(operator.user), reason="token leaked")
    elif how == "finished":
        runs.run_finish(run=run.run, actor=Actor.run(run.run))
    elif how == "expired":
        # Past expires_at, not yet marked by housekeeping: already ended for tokens.
        Run.objects.filter(pk=run.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    else:
        raise AssertionError(how)


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["revoked", "finished", "expired"])
def test_an_ended_runs_token_reads_only_its_run_and_its_actions(
    api: Any, run: Any, operator: Any, prod_alerts: Any, how: str
) -> None:
    own = make_action(
        run=run.run, identifier="notification-policy/prod-alerts", observed_version=41
    )
    sibling = make_active_run(
        run.agent, [{"resource": "dns-record/web-*", "operations": ["create"]}]
    )
    siblings_action = make_action(
        run=sibling.run, identifier="dns-record/web-1", operation="create"
    )
    # While the run is active the token reads everything an agent reads.
    assert api.get(PROD, token=run.token).status_code == 200
    assert api.get(f"/api/v1/actions/{siblings_action.pk}", token=run.token).status_code == 200

    _end_run(how, run, operator)

    shown = api.get(f"/api/v1/runs/{run.run.pk}", token=run.token)
    assert shown.status_code == 200 and json.loads(shown.content)["status"] == how
    listed = json.loads(api.get("/api/v1/runs", token=run.token).content)
    assert [item["id"] for item in listed["items"]] == [str(run.run.pk)]
    assert api.get(f"/api/v1/actions/{own.pk}", token=run.token).status_code == 200
    # Its agent's other run is none of its business any more.
    problem(api.get(f"/api/v1/actions/{siblings_action.pk}", token=run.token), 404, "not_found")
    for path in (
        PROD,
        "/api/v1/resources?kind=notification-policy",
        "/api/v1/actions",
        "/api/v1/kill-switch",
        "/api/v1/conflict-classes",
        "/api/v1/resource-kinds",
        "/api/v1/whoami",
    ):
        response = problem(api.get(path, token=run.token), 401, "unauthenticated")
        assert response["status"] == 401
    # Writes still identify the run: 409 run_not_active (contract), nothing recorded.
    before = Action.objects.count()
    problem(patch_prod(api, run.token), 409, "run_not_active")
    problem(api.post(f"/api/v1/actions/{own.pk}/cancel", token=run.token), 409, "run_not_active")
    problem(
        api.post(f"/api/v1/runs/{run.run.pk}/heartbeat", token=run.token), 409, "run_not_active"
    )
    assert Action.objects.count() == before
    # The agent token and the other run's token are untouched.
    assert api.get(PROD, token=sibling.token).status_code == 200


@pytest.mark.django_db
def test_a_pending_runs_token_still_reads(api: Any, agent: Any, prod_alerts: Any) -> None:
    created = api.create_run(
        agent.token,
        [{"resource": "notification-policy/prod-alerts", "operations": ["update"]}],
        task="wait for approval",
    )
    assert created.status_code == 201
    pending = json.loads(created.content)
    assert pending["status"] == "pending_approval"
    assert api.get(PROD, token=pending["token"]).status_code == 200
    problem(patch_prod(api, pending["token"]), 409, "run_not_active")


@pytest.mark.django_db
def test_a_revoked_runs_token_cannot_undo(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    """Review repro (/tmp/review/s2.py): revoke, then undo with the revoked rt_ token -> was 202."""
    from approvals.services.runs import RunNotActive, run_revoke
    from approvals.services.undo import action_undo_request

    action = applied_prod_alerts_action(run.run)
    run_revoke(run=run.run, actor=Actor.person(operator.user), reason="token leaked")
    body = problem(
        api.undo(action.pk, token=run.token, key="undo-revoked-1"),
        409,
        "run_not_active",
    )
    assert body["retryable"] is False
    # The service refuses it too (the console or a script calling it directly).
    with pytest.raises(RunNotActive):
        action_undo_request(
            action_id=action.pk,
            actor=Actor.run(Run.objects.get(pk=run.run.pk)),
            idempotency_key="undo-2",
        )
    assert not Operation.objects.filter(action=action, undo_of__isnull=False).exists()
    assert not AuditEvent.objects.filter(event_type="undo.requested").exists()
    # An operator may still undo it.
    accepted = api.undo(action.pk, token=operator.token, key="undo-operator-1")
    assert accepted.status_code == 202, accepted.content


# -- finding 11: undo authorises before it looks at the Idempotency-Key ---------------


@pytest.mark.django_db
def test_undo_answers_404_and_403_before_a_missing_idempotency_key(
    api: Any, run: Any, outsider: Any, operator: Any, prod_alerts: Any
) -> None:
    action = applied_prod_alerts_action(run.run)
    other = make_active_run(
        make_agent_with_token("other-bot").agent,
        [{"resource": "dns-record/zz-*", "operations": ["create"]}],
    )
    undo = f"/api/v1/actions/{action.pk}/undo"
    problem(api.post(undo, token=outsider.token), 404, "not_found")
    problem(api.post(undo, token=other.token), 404, "not_found")
    auditor = make_person_with_token("audrey", "auditors")  # may read it, may not undo it
    problem(api.post(undo, token=auditor.token), 403, "forbidden")
    # Only an authorised caller learns that the key is missing.
    problem(api.post(undo, token=operator.token), 400, "idempotency_key_missing")
    problem(api.post(undo, token=run.token), 400, "idempotency_key_missing")
    assert not Operation.objects.filter(action=action, undo_of__isnull=False).exists()


# -- helpers for forced collisions ----------------------------------------------------


# -- finding 2: revoke racing propose -------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_revoke_committing_while_a_write_is_proposed_leaves_no_queued_action(
    prod_alerts: Any,
) -> None:
    """check_writable passes, the operator's revoke is in flight (its transaction open),
    then the agent's propose runs: it must wait for the revoke and refuse (409), or be
    cancelled by it; never a `queued` action after the revoke."""
    from approvals.services import actions, runs

    agent = make_agent_with_token("race-bot")
    run = make_active_run(agent.agent, [{"resource": "dns-record/app-*", "operations": ["create"]}])
    operator = make_person_with_token("rita", "operators")
    # add_unique: per-run approval, so an accepted proposal is queued at once.
    kind = actions.action_check_writable(
        run=run.run, kind="dns-record", name="app-1", operation="create"
    )
    proposal = actions.Proposal(
        kind=kind,
        name="app-1",
        operation="create",
        payload_format="replace",
        payload={"target": "10.0.0.1"},
        if_match=None,
        create_if_absent=True,
        idempotency_key="race-propose-1",
        reason="",
    )
    revoker = Holder(
        lambda: runs.run_revoke(
            run=Run.objects.get(pk=run.run.pk), actor=Actor.person(operator.user), reason="x"
        )
    ).hold()
    proposer = Worker(lambda: actions.action_propose(run=run.run, proposal=proposal))
    proposer.start()
    # Blocked on the run row (fixed) or on the audit head (unfixed).
    wait_until_blocked_or_finished(proposer)
    assert revoker.release().status == "revoked"
    try:
        action = proposer.finish()
    except runs.RunNotActive:
        assert not Action.objects.filter(run=run.run).exists()
    else:
        action.refresh_from_db()
        assert action.status == "cancelled", action.status
    assert not Action.objects.filter(run=run.run, status="queued").exists()


@pytest.mark.django_db
def test_propose_rechecks_the_run_under_its_lock(run: Any, prod_alerts: Any) -> None:
    """The gap the review reproduced, in order: check passes, revoke commits, propose."""
    from approvals.services import actions, runs

    proposal = _low_severity_proposal(run.run, "gap-propose-1")
    runs.run_revoke(run=run.run, actor=Actor.system("tests"), reason="stop")
    with pytest.raises(runs.RunNotActive):
        actions.action_propose(run=run.run, proposal=proposal)
    assert not Action.objects.filter(run=run.run).exists()
    assert not AuditEvent.objects.filter(event_type="action.proposed").exists()


# -- finding 3: transient database errors are retryable 503s, not 500s -----------------


def _real_deadlock() -> OperationalError:
    """Two transactions lock two rows in opposite orders: PostgreSQL aborts one."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS review_deadlock (id int PRIMARY KEY)")
        cursor.execute("INSERT INTO review_deadlock VALUES (1), (2) ON CONFLICT DO NOTHING")
    first_locked = threading.Event()
    second_locked = threading.Event()

    def lock(mine: int, theirs: int, me: threading.Event, other: threading.Event) -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT id FROM review_deadlock WHERE id = %s FOR UPDATE", [mine])
            me.set()
            assert other.wait(WAIT)
            cursor.execute("SELECT id FROM review_deadlock WHERE id = %s FOR UPDATE", [theirs])

    a = Worker(lambda: lock(1, 2, first_locked, second_locked))
    b = Worker(lambda: lock(2, 1, second_locked, first_locked))
    a.start()
    b.start()
    errors = finish_each(a, b)
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.django_db(transaction=True)
def test_a_deadlock_is_a_retryable_503_transient_conflict_not_a_500() -> None:
    from console.api import api as ninja_api
    from console.problems import unexpected_error_response

    error = _real_deadlock()
    request = RequestFactory().post("/api/v1/actions/x/cancel")
    for response in (
        ninja_api.on_exception(request, error),  # raised inside a handler
        unexpected_error_response(request, error),  # raised outside ninja (the URL wrapper)
    ):
        body = problem(response, 503, "transient_conflict")
        assert body["retryable"] is True and body["sqlstate"] == "40P01"
        assert response["Retry-After"] == "1"
    document = ninja_api.get_openapi_schema()
    cancel = document["paths"]["/api/v1/actions/{action_id}/cancel"]["post"]
    assert "Retry-After" in cancel["responses"]["503"]["headers"]


# -- finding 10: leases ----------------------------------------------------------------


@pytest.mark.django_db
def test_a_lease_in_the_write_set_blocks_other_runs_writes_with_423_until_it_ends(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    """`run` holds prod-alerts update/delete; a second run asks for create with a
    lease (no shared operation, so no write_set_conflict): from its activation on,
    `run`'s PATCH is 423 leased; once the leaseholder finishes, it is accepted."""
    holder_agent = make_agent_with_token("lease-bot")
    created = api.create_run(
        holder_agent.token,
        [
            {
                "resource": "notification-policy/prod-alerts",
                "operations": ["create"],
                "lease": True,
            }
        ],
        task="hold prod alerts",
    )
    assert created.status_code == 201, created.content
    holder_body = json.loads(created.content)
    assert holder_body["write_set"][0]["lease"] is True
    # Pending approval: no lease yet, `run` may still propose.
    in_flight = patch_prod(api, run.token, key="key-lease-0001")
    assert in_flight.status_code == 202
    from approvals.services.runs import run_activate
    from approvals.services.write_sets import WriteSetConflict

    holder = Run.objects.get(pk=holder_body["id"])
    # No lease over a write still in flight: the grant is refused, the run stays pending.
    with pytest.raises(WriteSetConflict) as refused:
        run_activate(run=holder, actor=Actor.system("tests"))
    assert refused.value.extra["overlaps"][0]["action"] == json.loads(in_flight.content)["id"]
    assert not OwnershipRecord.objects.filter(run=holder).exists()
    cancel = api.post(
        f"/api/v1/actions/{json.loads(in_flight.content)['id']}/cancel", token=run.token
    )
    assert cancel.status_code == 200
    run_activate(run=holder, actor=Actor.system("tests"))
    lease = OwnershipRecord.objects.get(run=holder, exclusive=True)
    assert lease.fence is not None and lease.fence > 0 and lease.active

    before = Action.objects.count()
    body = problem(patch_prod(api, run.token, key="key-lease-0002"), 423, "leased")
    assert body["retryable"] is True
    holder.refresh_from_db()
    assert body["lease"] == {"run": str(holder.pk), "expires_at": holder.expires_at.isoformat()}
    assert Action.objects.count() == before

    finished = api.post(f"/api/v1/runs/{holder.pk}/finish", token=holder_body["token"])
    assert finished.status_code == 200
    lease.refresh_from_db()
    assert not lease.active and lease.released_at is not None
    assert patch_prod(api, run.token, key="key-lease-0003").status_code == 202


@pytest.mark.django_db
def test_a_lease_ends_with_an_expired_run(api: Any, run: Any, prod_alerts: Any) -> None:
    holder = make_active_run(
        make_agent_with_token("lease-bot").agent,
        [{"resource": "notification-policy/prod-*", "operations": ["create"], "lease": True}],
    )
    problem(patch_prod(api, run.token, key="key-lease-0101"), 423, "leased")
    Run.objects.filter(pk=holder.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert patch_prod(api, run.token, key="key-lease-0102").status_code == 202


@pytest.mark.django_db
def test_two_runs_never_hold_overlapping_leases(api: Any, agent: Any) -> None:
    make_active_run(
        make_agent_with_token("lease-bot").agent,
        [{"resource": "dns-record/app-*", "operations": ["create"], "lease": True}],
    )
    body = problem(
        api.create_run(
            agent.token,
            [{"resource": "dns-record/app-web", "operations": ["delete"], "lease": True}],
            task="second lease",
        ),
        409,
        "write_set_conflict",
    )
    assert body["overlaps"][0]["lease"] is True
    # Without a lease, disjoint operations on the same names are fine (and get 423 on write).
    assert (
        api.create_run(
            agent.token,
            [{"resource": "dns-record/app-web", "operations": ["delete"]}],
            task="no lease",
        ).status_code
        == 201
    )
    problem(
        api.create_run(
            agent.token,
            [{"resource": "dns-record/app-web", "operations": ["delete"], "lease": "yes"}],
            task="bad lease flag",
        ),
        422,
        "validation_error",
    )


# -- finding 13: /audit/verify does not walk the whole chain on every call ------------


def _audit_queries(queries: Any) -> list[str]:
    """The walks: the reads of events with their links (not the linker's look past the head)."""
    return [
        q["sql"]
        for q in queries
        if 'FROM "audit_auditevent"' in q["sql"] and '"prev_hash"' in q["sql"]
    ]


@pytest.mark.django_db
def test_audit_verify_is_cached_per_head_and_walks_only_the_new_tail(
    api: Any, auditor: Any
) -> None:
    from django.core.cache import cache
    from django.test.utils import CaptureQueriesContext

    from audit.services import BROKEN_KEY, CHECKPOINT_KEY, audit_append
    from audit.verify import verify_chain

    cache.delete_many([CHECKPOINT_KEY, BROKEN_KEY])
    for number in range(5):
        audit_append(event_type="test.event", actor=Actor.system("tests"), details={"n": number})
    first = json.loads(api.get("/api/v1/audit/verify", token=auditor.token).content)
    assert first["ok"] is True and first["cached"] is False
    events = first["events"]
    assert events == verify_chain().events >= 5

    with CaptureQueriesContext(connection) as unchanged:
        again = json.loads(api.get("/api/v1/audit/verify", token=auditor.token).content)
    assert again["cached"] is True and again["events"] == events
    assert _audit_queries(unchanged.captured_queries) == []  # no walk at all

    for number in range(3):
        audit_append(event_type="test.event", actor=Actor.system("tests"), details={"m": number})
    with CaptureQueriesContext(connection) as moved:
        tail = json.loads(api.get("/api/v1/audit/verify", token=auditor.token).content)
    assert tail["cached"] is False and tail["ok"] is True
    full = verify_chain()
    assert tail["events"] == full.events == events + 3
    assert tail["head_hash"] == full.head_hash
    walks = _audit_queries(moved.captured_queries)
    assert len(walks) == 1 and f'"seq" > {events}' in walks[0], walks


@pytest.mark.django_db(transaction=True)
def test_a_console_page_that_deadlocks_answers_503_with_retry_after() -> None:
    from console.middleware import RequestIdMiddleware

    error = _real_deadlock()
    middleware = RequestIdMiddleware(lambda request: None)
    request = RequestFactory().post("/approvals/x/decision")
    response = middleware.process_exception(request, error)
    assert response is not None and response.status_code == 503
    assert response["Retry-After"] == "1"
    assert b"nothing was saved" in response.content
    assert middleware.process_exception(request, ValueError("a bug")) is None  # still a 500


@pytest.mark.django_db(transaction=True)
def test_a_lease_grant_racing_another_runs_proposal_never_leaves_a_write_in_flight_under_it(
    prod_alerts: Any,
) -> None:
    """The proposal's transaction is held open after it recorded its action; the
    lease grant (run_activate) must wait for it and then refuse the lease. Without
    the shared kind lock the grant does not see the uncommitted action and leases
    a resource another run is about to write."""
    from approvals.services import actions
    from approvals.services.runs import run_activate, run_create
    from approvals.services.write_sets import WriteSetConflict

    writer = make_active_run(make_agent_with_token("writer-bot").agent)
    holder_agent = make_agent_with_token("lease-bot")
    holder, _ = run_create(
        agent=holder_agent.agent,
        task="lease prod alerts",
        write_set=[
            {"resource": "notification-policy/prod-alerts", "operations": ["create"], "lease": True}
        ],
        ttl_seconds=600,
        actor=Actor.agent(holder_agent.agent),
    )
    proposal = _low_severity_proposal(writer.run, "race-lease-1")
    proposer = Holder(lambda: actions.action_propose(run=writer.run, proposal=proposal)).hold()
    granter = Worker(lambda: run_activate(run=holder, actor=Actor.system("tests")))
    granter.start()
    wait_until_blocked_or_finished(granter)
    action = proposer.release()
    with pytest.raises(WriteSetConflict):
        granter.finish()
    assert not OwnershipRecord.objects.filter(run=holder, exclusive=True).exists()
    assert Action.objects.get(pk=action.pk).status == "pending_approval"


@pytest.mark.django_db
def test_stop_unless_lease_reports_a_real_lease_on_a_conflict(agent: Any, prod_alerts: Any) -> None:
    """replace_shared_document (stop_unless_lease): a stale write of a run holding a
    lease granted through its write set carries lease_covered: true."""
    from approvals.services.execution import action_execute

    holder = make_active_run(
        agent.agent,
        [{"resource": "notification-policy/prod-alerts", "operations": ["update"], "lease": True}],
    )
    stale = make_action(
        run=holder.run,
        identifier="notification-policy/prod-alerts",
        payload={"severity": "low"},
        observed_version=40,  # the resource is at 41
    )
    assert stale.conflict_class.on_conflict == "stop_unless_lease"
    assert action_execute(action_id=stale.pk) == "conflict"
    stale.refresh_from_db()
    assert stale.status == "conflict" and stale.error["lease_covered"] is True


def _low_severity_proposal(run: Run, idempotency_key: str) -> Any:
    """An update of notification-policy/prod-alerts at "41", checked writable for `run`."""
    kind = actions.action_check_writable(
        run=run, kind="notification-policy", name="prod-alerts", operation="update"
    )
    return actions.Proposal(
        kind=kind,
        name="prod-alerts",
        operation="update",
        payload_format="replace",
        payload={"severity": "low"},
        if_match=preconditions.parse_tag_condition('"41"', header="If-Match"),
        create_if_absent=False,
        idempotency_key=idempotency_key,
        reason="",
    )
