"""Issue 42 §2: scoped standing grants ("approve and allow similar"), through the API on
PostgreSQL: a grant admits exactly its uses under concurrent proposals, the next write
waits for a person; expired or revoked grants admit none (a revoke racing a proposal
included); never outside the prefix, on a class that forbids grants, above a quorum of one,
in another run; each use audited; every bad request a 4xx that changes nothing."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from approvals.models import Action, Approval, ApprovalDecision, Grant
from audit.models import AuditEvent
from ownership.models import ConflictClass
from tests.fixtures.api import (
    ApiClient,
    make_active_run,
    make_agent_with_token,
    make_person_with_token,
    problem,
)
from tests.fixtures.core import make_kind
from tests.races import Holder, Worker, wait_for_lock_waiters

# advance_pointer: per call, quorum 1, grants allowed (the seeded defaults).
FLAGS_WRITE_SET = [
    {"resource": "feature-flag/team-a-*", "operations": ["create", "update"]},
    {"resource": "feature-flag/exact-one", "operations": ["create"]},
]


def _flags_kind() -> Any:
    return make_kind(
        "feature-flag", create="advance_pointer", update="advance_pointer", delete="access_change"
    )


def _flags_run(agent: Any) -> Any:
    _flags_kind()
    return make_active_run(agent, FLAGS_WRITE_SET)


def _create(api: Any, run: Any, name: str) -> Any:
    return api.write(run.token, "put", f"feature-flag/{name}", {"on": True}, if_none_match="*")


def _pending_approval(api: Any, run: Any, name: str) -> Approval:
    response = _create(api, run, name)
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["status"] == "pending_approval", body
    return Approval.objects.get(action_id=body["id"])


def _grant_decision(
    api: Any, person: Any, approval: Approval, *, status: int = 200, **grant: Any
) -> Any:
    body = {"uses": 3, "ttl_seconds": 3600, "name_prefix": "team-a-", **grant}
    response = api.post(
        f"/api/v1/approvals/{approval.pk}/decision",
        token=person.token,
        body={"decision": "approve", "comment": "same flag family", "grant": body},
    )
    assert response.status_code == status, response.content
    return response


@pytest.fixture
def flags(db: Any) -> Any:
    bot = make_agent_with_token("flag-bot")
    return _flags_run(bot.agent)


@pytest.mark.django_db
def test_an_approval_with_a_grant_approves_and_records_the_grant(
    api: Any, flags: Any, operator: Any
) -> None:
    approval = _pending_approval(api, flags, "team-a-0")

    answer = _grant_decision(api, operator, approval).json()

    assert answer["status"] == "approved"
    grant = Grant.objects.get()
    assert (grant.kind_id, grant.operation, grant.name_prefix) == (
        "feature-flag",
        "create",
        "team-a-",
    )
    assert grant.run_id == flags.run.pk and grant.scope == "run"
    assert grant.owner_id == operator.user.pk and grant.reason == "same flag family"
    assert (grant.uses, grant.used) == (3, 0)
    assert timedelta(seconds=3590) < grant.expires_at - timezone.now() <= timedelta(seconds=3600)
    created = AuditEvent.objects.get(event_type="grant.created")
    assert created.details["grant"] == grant.pk and created.actor_id == str(operator.user.pk)

    listed = api.get("/api/v1/grants", token=operator.token).json()["items"]
    assert [item["id"] for item in listed] == [grant.pk]
    one = api.get(f"/api/v1/grants/{grant.pk}", token=operator.token).json()
    assert one["uses_left"] == 3 and one["state"] == "live" and one["owner"] == "ana"
    assert one["run"] == str(flags.run.pk) and one["agent"] == "flag-bot"


@pytest.mark.django_db
def test_a_grant_admits_its_uses_then_the_next_write_waits_and_each_use_is_audited(
    api: Any, flags: Any, operator: Any
) -> None:
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"), uses=2)
    grant = Grant.objects.get()

    first, second, third = (_create(api, flags, f"team-a-{n}").json() for n in (1, 2, 3))

    assert [first["status"], second["status"]] == ["queued", "queued"]
    assert third["status"] == "pending_approval"
    assert Approval.objects.filter(action_id=third["id"], status="pending").exists()
    assert not Approval.objects.filter(action_id__in=[first["id"], second["id"]]).exists()
    assert list(
        Action.objects.filter(grant=grant).values_list("name", flat=True).order_by("name")
    ) == [
        "team-a-1",
        "team-a-2",
    ]
    uses = list(AuditEvent.objects.filter(event_type="grant.used").order_by("seq"))
    assert [str(event.action_id) for event in uses] == [first["id"], second["id"]]
    assert {event.details["grant"] for event in uses} == {grant.pk}
    assert [event.details["uses_left"] for event in uses] == [1, 0]
    grant.refresh_from_db()
    assert grant.used == 2
    assert api.get(f"/api/v1/grants/{grant.pk}", token=operator.token).json()["state"] == "spent"
    # The dashboard's figure: two decisions saved in the last 7 days.
    from console.views import dashboard_counts

    assert dashboard_counts(operator.user)["grant_saved_week"] == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_32_concurrent_proposals_against_a_grant_of_3_admit_exactly_3(
    operator: Any,
) -> None:
    bot = make_agent_with_token("flag-bot")
    flags = _flags_run(bot.agent)
    api = ApiClient()
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"))
    grant = Grant.objects.get()
    start = threading.Barrier(32)

    def propose(n: int) -> Any:
        client = ApiClient()
        start.wait(20)
        return _create(client, flags, f"team-a-{n}")

    workers = [Worker(lambda n=n: propose(n)) for n in range(1, 33)]
    for worker in workers:
        worker.start()
    responses = [worker.finish() for worker in workers]

    assert [response.status_code for response in responses] == [202] * 32
    statuses = sorted(response.json()["status"] for response in responses)
    assert statuses.count("queued") == 3, statuses
    assert statuses.count("pending_approval") == 29, statuses
    grant.refresh_from_db()
    assert grant.used == 3
    assert Action.objects.filter(grant=grant).count() == 3
    assert AuditEvent.objects.filter(event_type="grant.used").count() == 3
    # The 29 others each wait for a person.
    assert (
        Approval.objects.filter(status="pending", action__name__startswith="team-a-").count() == 29
    )


@pytest.mark.django_db
def test_an_expired_grant_admits_nothing(api: Any, flags: Any, operator: Any) -> None:
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"))
    Grant.objects.update(expires_at=timezone.now() - timedelta(seconds=1))

    assert _create(api, flags, "team-a-1").json()["status"] == "pending_approval"
    assert Grant.objects.get().used == 0
    assert not AuditEvent.objects.filter(event_type="grant.used").exists()


@pytest.mark.django_db
def test_a_revoked_grant_admits_nothing_and_waiting_writes_keep_waiting(
    api: Any, flags: Any, operator: Any, admin: Any, outsider: Any
) -> None:
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"))
    grant = Grant.objects.get()
    assert _create(api, flags, "team-a-1").json()["status"] == "queued"

    # Someone who may not see it: 404; the owner revokes.
    problem(api.delete(f"/api/v1/grants/{grant.pk}", token=outsider.token), 404, "not_found")
    response = api.delete(f"/api/v1/grants/{grant.pk}", token=operator.token)
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "revoked" and response.json()["revoked_by"] == "ana"
    again = api.delete(f"/api/v1/grants/{grant.pk}", token=admin.token)
    assert again.status_code == 200 and again.json()["revoked_by"] == "ana"

    waiting = _create(api, flags, "team-a-2").json()
    assert waiting["status"] == "pending_approval"
    assert Grant.objects.get().used == 1
    assert AuditEvent.objects.filter(event_type="grant.revoked").count() == 1
    # The revoke leaves a waiting write waiting (nothing decided it).
    assert Approval.objects.get(action_id=waiting["id"]).status == "pending"


@pytest.mark.django_db
def test_a_write_waiting_for_a_person_is_not_approved_by_a_later_grant(
    api: Any, flags: Any, operator: Any
) -> None:
    waiting = _pending_approval(api, flags, "team-a-1")
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"))

    waiting.refresh_from_db()
    assert waiting.status == "pending"
    assert Action.objects.get(pk=waiting.action_id).status == "pending_approval"


@pytest.mark.django_db(transaction=True)
def test_a_revoke_committing_while_a_proposal_waits_for_the_grant_admits_nothing(
    operator: Any,
) -> None:
    bot = make_agent_with_token("flag-bot")
    flags = _flags_run(bot.agent)
    api = ApiClient()
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"))
    grant_id = Grant.objects.get().pk

    # The revoke's UPDATE holds the grant row; the proposal's use waits on it, then sees
    # the revoke once it commits.
    holder = Holder(
        lambda: Grant.objects.filter(pk=grant_id).update(revoked_at=timezone.now())
    ).hold()
    proposal = Worker(lambda: _create(ApiClient(), flags, "team-a-1"))
    proposal.start()
    wait_for_lock_waiters(1, threads=(proposal,))
    holder.release()
    response = proposal.finish()

    assert response.json()["status"] == "pending_approval"
    assert Grant.objects.get().used == 0


def _finish(run: Any) -> None:
    from approvals.services.runs import run_finish
    from audit.services import Actor

    run_finish(run=run.run, actor=Actor.run(run.run))


@pytest.mark.django_db
def test_never_outside_the_prefix_or_the_operation(api: Any, flags: Any, operator: Any) -> None:
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"), uses=10)

    outside = _create(api, flags, "exact-one").json()
    assert outside["status"] == "pending_approval"
    assert Grant.objects.get().used == 0


@pytest.mark.django_db
def test_a_run_grant_ends_with_its_run_and_an_admins_agent_grant_crosses_runs(
    api: Any, flags: Any, operator: Any, admin: Any
) -> None:
    # The run's grant does not outlive it: the agent's next run waits for a person.
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"), uses=10)
    _finish(flags)
    one = api.get(f"/api/v1/grants/{Grant.objects.get().pk}", token=operator.token).json()
    assert one["state"] == "run_ended"
    later = make_active_run(flags.agent, FLAGS_WRITE_SET)
    assert _create(api, later, "team-a-5").json()["status"] == "pending_approval"
    assert Grant.objects.get().used == 0

    # Not an admin: no agent-wide grant, and nothing decided.
    approval = _pending_approval(api, later, "team-a-6")
    refused = _grant_decision(api, operator, approval, status=403, scope="agent")
    assert problem(refused, 403, "forbidden")
    approval.refresh_from_db()
    assert approval.status == "pending"
    assert not ApprovalDecision.objects.filter(approval=approval).exists()

    _grant_decision(api, admin, approval, scope="agent", uses=5)
    grant = Grant.objects.get(scope="agent")
    assert grant.run_id is None and grant.agent_id == flags.agent.pk
    _finish(later)
    third = make_active_run(flags.agent, FLAGS_WRITE_SET)
    assert _create(api, third, "team-a-7").json()["status"] == "queued"
    # Another agent's run: not admitted.
    _finish(third)
    stranger = make_active_run(make_agent_with_token("other-bot").agent, FLAGS_WRITE_SET)
    assert _create(api, stranger, "team-a-8").json()["status"] == "pending_approval"
    grant.refresh_from_db()
    assert grant.used == 1


@pytest.mark.django_db
def test_never_on_a_class_that_forbids_grants_or_above_a_quorum_of_one(
    api: Any, flags: Any, operator: Any
) -> None:
    assert not ConflictClass.objects.get(slug="access_change").grants_allowed
    assert not ConflictClass.objects.get(slug="replace_shared_document").grants_allowed
    # The class forbids grants: the decision with a grant is refused, nothing decided.
    ConflictClass.objects.filter(slug="advance_pointer").update(grants_allowed=False)
    approval = _pending_approval(api, flags, "team-a-0")
    body = problem(_grant_decision(api, operator, approval, status=403), 403, "forbidden")
    assert "forbids" in body["detail"]
    approval.refresh_from_db()
    assert approval.status == "pending" and not Grant.objects.exists()

    # A class whose quorum is two: refused as well.
    ConflictClass.objects.filter(slug="advance_pointer").update(grants_allowed=True, quorum=2)
    two = _pending_approval(api, flags, "team-a-1")
    problem(_grant_decision(api, operator, two, status=403), 403, "forbidden")
    assert not Grant.objects.exists() and not ApprovalDecision.objects.exists()

    # A grant made at quorum one no longer admits once the class needs two people, nor
    # once it forbids grants.
    ConflictClass.objects.filter(slug="advance_pointer").update(quorum=1)
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-2"))
    ConflictClass.objects.filter(slug="advance_pointer").update(quorum=2)
    assert _create(api, flags, "team-a-3").json()["status"] == "pending_approval"
    ConflictClass.objects.filter(slug="advance_pointer").update(quorum=1, grants_allowed=False)
    assert _create(api, flags, "team-a-4").json()["status"] == "pending_approval"
    ConflictClass.objects.filter(slug="advance_pointer").update(grants_allowed=True)
    assert _create(api, flags, "team-a-5").json()["status"] == "queued"


@pytest.mark.django_db
def test_a_prefix_wider_than_the_write_set_or_not_covering_the_write_is_refused(
    api: Any, flags: Any, operator: Any
) -> None:
    approval = _pending_approval(api, flags, "team-a-0")
    wider = _grant_decision(api, operator, approval, status=403, name_prefix="team-")
    assert problem(wider, 403, "not_in_write_set")["resource"] == "feature-flag/team-*"
    elsewhere = _grant_decision(api, operator, approval, status=422, name_prefix="team-b-")
    assert problem(elsewhere, 422, "validation_error")["errors"][0]["field"] == "grant.name_prefix"
    exact = _pending_approval(api, flags, "exact-one")
    problem(
        _grant_decision(api, operator, exact, status=403, name_prefix="exact-one"),
        403,
        "not_in_write_set",
    )
    approval.refresh_from_db()
    assert approval.status == "pending"
    assert not Grant.objects.exists() and not ApprovalDecision.objects.exists()
    # A narrower prefix is fine.
    _grant_decision(api, operator, approval, name_prefix="team-a-0")
    assert Grant.objects.get().name_prefix == "team-a-0"


@pytest.mark.django_db
@override_settings(AIRLOCK_GRANT_MAX_USES=10, AIRLOCK_GRANT_MAX_TTL_SECONDS=7200)
@pytest.mark.parametrize(
    ("grant", "status", "field"),
    [
        ({"uses": 11}, 422, "grant.uses"),
        ({"uses": 0}, 422, None),
        ({"ttl_seconds": 7201}, 422, "grant.ttl_seconds"),
        ({"ttl_seconds": 59}, 422, None),
        ({"uses": "3"}, 422, None),
        ({"name_prefix": "a\nb"}, 422, None),
        ({"scope": "world"}, 422, None),
        ({"surprise": 1}, 422, None),
    ],
)
def test_bad_grant_values_are_422_and_change_nothing(
    api: Any, flags: Any, operator: Any, grant: dict[str, Any], status: int, field: str | None
) -> None:
    approval = _pending_approval(api, flags, "team-a-0")
    response = _grant_decision(api, operator, approval, status=status, **grant)
    body = problem(response, status, "validation_error")
    if field is not None:
        assert body["errors"][0]["field"] == field
    approval.refresh_from_db()
    assert approval.status == "pending"
    assert not Grant.objects.exists() and not ApprovalDecision.objects.exists()


@pytest.mark.django_db
def test_a_grant_needs_uses_and_ttl_and_goes_with_approve_only(
    api: Any, flags: Any, operator: Any
) -> None:
    approval = _pending_approval(api, flags, "team-a-0")
    url = f"/api/v1/approvals/{approval.pk}/decision"
    for grant in ({"ttl_seconds": 60, "name_prefix": ""}, {"uses": 1, "name_prefix": ""}):
        problem(
            api.post(url, token=operator.token, body={"decision": "approve", "grant": grant}),
            422,
            "validation_error",
        )
    grant = {"uses": 1, "ttl_seconds": 60, "name_prefix": "team-a-"}
    reject = api.post(
        url, token=operator.token, body={"decision": "reject", "comment": "no", "grant": grant}
    )
    problem(reject, 422, "validation_error")
    edit = api.post(
        url,
        token=operator.token,
        body={"decision": "approve_with_edits", "document": {"on": False}, "grant": grant},
    )
    problem(edit, 422, "validation_error")
    approval.refresh_from_db()
    assert approval.status == "pending" and not Grant.objects.exists()


@pytest.mark.django_db
def test_grants_api_visibility_and_revocation_rights(
    api: Any, flags: Any, operator: Any, admin: Any, auditor: Any, outsider: Any
) -> None:
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"))
    grant = Grant.objects.get()
    second = make_person_with_token("bea", "operators")

    for reader in (operator, admin, auditor, second):
        items = api.get("/api/v1/grants", token=reader.token).json()["items"]
        assert [item["id"] for item in items] == [grant.pk]
    assert api.get("/api/v1/grants", token=outsider.token).json()["items"] == []
    problem(api.get(f"/api/v1/grants/{grant.pk}", token=outsider.token), 404, "not_found")
    problem(api.get("/api/v1/grants/999999", token=operator.token), 404, "not_found")
    problem(api.get("/api/v1/grants/0", token=operator.token), 422, "validation_error")
    problem(api.get("/api/v1/grants", token=None), 401, "unauthenticated")
    problem(api.get("/api/v1/grants?state=nope", token=operator.token), 422, "validation_error")
    # Another operator and an auditor see it, but only its owner or an admin revokes it.
    problem(api.delete(f"/api/v1/grants/{grant.pk}", token=second.token), 403, "forbidden")
    problem(api.delete(f"/api/v1/grants/{grant.pk}", token=auditor.token), 403, "forbidden")
    assert Grant.objects.get().revoked_at is None
    assert api.delete(f"/api/v1/grants/{grant.pk}", token=admin.token).json()["state"] == "revoked"
    live = api.get("/api/v1/grants?state=live", token=operator.token).json()["items"]
    assert live == []


@pytest.mark.django_db
def test_the_agent_cannot_use_the_grants_api(api: Any, flags: Any, operator: Any) -> None:
    _grant_decision(api, operator, _pending_approval(api, flags, "team-a-0"))
    problem(api.get("/api/v1/grants", token=flags.token), 403, "forbidden")
    grant = Grant.objects.get()
    response = api.delete(f"/api/v1/grants/{grant.pk}", token=flags.token)
    assert response.status_code in (401, 403)
    assert Grant.objects.get().revoked_at is None


@pytest.mark.django_db
def test_the_conflict_class_api_shows_and_takes_back_grants_allowed(api: Any, admin: Any) -> None:
    url = "/api/v1/conflict-classes/advance_pointer"
    body = api.get(url, token=admin.token).json()
    assert body["grants_allowed"] is True
    body["grants_allowed"] = False
    response = api.put(url, token=admin.token, body=body)
    assert response.status_code == 200, response.content
    assert response.json()["grants_allowed"] is False
    assert not ConflictClass.objects.get(slug="advance_pointer").grants_allowed
    forbidding = api.get("/api/v1/conflict-classes/access_change", token=admin.token).json()
    assert forbidding["grants_allowed"] is False
