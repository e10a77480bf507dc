"""Issue 9, items 7 and 11 (first half): an Idempotency-Key never makes two
actions, even when a retry takes over a stalled request's key; and undo honours
its Idempotency-Key exactly like a write.

The stall is real: the original request is held on a PostgreSQL row lock (the
run row, FOR UPDATE in another transaction) until its key is past the in-flight
window, and the retry is observed blocked behind the same lock before both go.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, IdempotencyRecord, Operation, Run
from approvals.services import idempotency
from audit.models import AuditEvent
from tests.fixtures.api import (
    PROD_ALERTS,
    ApiClient,
    ensure_api_kinds,
    make_active_run,
    make_agent_with_token,
)
from tests.fixtures.core import execute, make_action
from tests.races import WAIT, Holder, Worker, wait_for_lock_waiters

pytestmark = pytest.mark.django_db

PROD = "/api/v1/resources/notification-policy/prod-alerts"
KEY = "key-stalled-0001"


def patch_prod(token: str, key: str) -> Any:
    return ApiClient().patch(
        PROD,
        token=token,
        body={"severity": "critical"},
        headers={"If-Match": '"41"', "Idempotency-Key": key},
    )


@pytest.mark.django_db(transaction=True)
def test_a_retry_that_takes_over_a_stalled_key_and_the_original_record_one_action(
    prod_alerts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ensure_api_kinds()
    run = make_active_run(make_agent_with_token("stall-bot").agent)
    window = timedelta(seconds=1)
    monkeypatch.setattr(idempotency, "IN_FLIGHT_ABANDONED_AFTER", window)
    # Every proposal takes the run row FOR SHARE after claiming its key: holding it
    # FOR UPDATE stalls the original between the claim and the record.
    holder = Holder(lambda: list(Run.objects.select_for_update().filter(pk=run.run.pk))).hold()
    original = Worker(lambda: patch_prod(run.token, KEY))
    original.start()
    wait_for_lock_waiters(1, threads=(original,))
    claimed = IdempotencyRecord.objects.get(key=KEY)
    deadline = time.monotonic() + WAIT
    while timezone.now() - claimed.created_at <= window + timedelta(milliseconds=200):
        assert time.monotonic() < deadline
        time.sleep(0.05)  # the stall itself: real time passing, no assertion on it
    retry = Worker(lambda: patch_prod(run.token, KEY))
    retry.start()
    wait_for_lock_waiters(2, threads=(original, retry))
    taken_over = IdempotencyRecord.objects.get(key=KEY)
    assert taken_over.pk != claimed.pk  # the retry took the key over
    holder.release()
    answers = [original.finish(), retry.finish()]

    assert Action.objects.filter(run=run.run, idempotency_key=KEY).count() == 1
    assert AuditEvent.objects.filter(event_type="action.proposed").count() == 1
    assert sorted(answer.status_code for answer in answers) == [202, 409]
    winner = next(answer for answer in answers if answer.status_code == 202)
    loser = json.loads(next(a for a in answers if a.status_code == 409).content)
    assert loser["code"] == "idempotency_key_in_flight" and loser["retryable"] is True
    record = IdempotencyRecord.objects.get(key=KEY)
    assert record.status == "done" and str(record.action_id) == json.loads(winner.content)["id"]
    # The loser's client retries and gets the winner's answer.
    again = patch_prod(run.token, KEY)
    assert again.status_code == 202 and again["Idempotent-Replayed"] == "true"
    assert again.content == winner.content


def test_completing_a_record_that_was_taken_over_raises_and_rolls_the_request_back(
    run: Any, prod_alerts: Any
) -> None:
    from django.db import transaction

    from audit.services import Actor, audit_append

    begin = idempotency.idempotency_begin(
        actor=Actor.agent(run.agent),
        key="key-gone-00001",
        method="PATCH",
        path=PROD,
        fingerprint="f" * 64,
    )
    assert begin.record_id is not None
    IdempotencyRecord.objects.filter(pk=begin.record_id).delete()  # a retry took it over
    events = AuditEvent.objects.count()
    stored = idempotency.StoredResponse(status=202, headers={}, body=b"{}")
    with pytest.raises(idempotency.IdempotencyKeyError) as refused, transaction.atomic():
        audit_append(event_type="action.proposed", actor=Actor.run(run.run), details={})
        idempotency.idempotency_complete(record_id=begin.record_id, response=stored)
    assert refused.value.code == "idempotency_key_in_flight"
    assert AuditEvent.objects.count() == events  # what the request wrote rolled back


# -- undo honours Idempotency-Key ----------------------------------------------------------


def _applied_action(run: Any, observed_version: int) -> Action:
    action: Action = make_action(
        run=run.run,
        identifier="notification-policy/prod-alerts",
        payload={"severity": f"v{observed_version}"},
        observed_version=observed_version,
    )
    assert execute(action).applied
    return action


def undo_requests() -> int:
    return AuditEvent.objects.filter(event_type="undo.requested").count()


@pytest.fixture(params=["run", "operator"])
def undo_token(request: pytest.FixtureRequest, run: Any, operator: Any) -> str:
    """Each undo test runs twice: with the run's token and with an operator's."""
    return str(run.token if request.param == "run" else operator.token)


def test_an_undo_retried_with_its_key_replays_the_first_answer(
    api: Any, run: Any, prod_alerts: Any, undo_token: str
) -> None:
    action = _applied_action(run, 41)
    first = api.undo(action.pk, token=undo_token, key="undo-key-0001")
    assert first.status_code == 202, first.content
    assert "Idempotent-Replayed" not in first
    # The action moves on, so a fresh answer would differ from the stored one.
    Action.objects.filter(pk=action.pk).update(reason="changed since")
    again = api.undo(action.pk, token=undo_token, key="undo-key-0001")
    assert again.status_code == 202
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert again["Location"] == first["Location"] and again["ETag"] == first["ETag"]
    assert Operation.objects.filter(action=action, undo_of__isnull=False).count() == 1
    assert undo_requests() == 1


def test_an_undo_replay_is_answered_even_after_the_window_closed(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    action = _applied_action(run, 41)
    first = api.undo(action.pk, token=run.token, key="undo-key-late1")
    assert first.status_code == 202
    Operation.objects.filter(action=action, undo_of__isnull=True).update(
        undo_deadline=timezone.now() - timedelta(seconds=1)
    )
    again = api.undo(action.pk, token=run.token, key="undo-key-late1")
    assert (again.status_code, again["Idempotent-Replayed"]) == (202, "true")
    assert again.content == first.content


def test_an_undo_key_reused_for_another_action_is_422_and_changes_nothing(
    api: Any, run: Any, prod_alerts: Any, undo_token: str
) -> None:
    first_action = _applied_action(run, 41)
    second_action = _applied_action(run, 42)
    assert api.undo(first_action.pk, token=undo_token, key="undo-key-reuse").status_code == 202
    records, audit = IdempotencyRecord.objects.count(), AuditEvent.objects.count()
    response = api.undo(second_action.pk, token=undo_token, key="undo-key-reuse")
    assert response.status_code == 422, response.content
    assert json.loads(response.content)["code"] == "idempotency_key_reused"
    assert not Operation.objects.filter(action=second_action, undo_of__isnull=False).exists()
    assert (IdempotencyRecord.objects.count(), AuditEvent.objects.count()) == (records, audit)


def test_a_write_key_reused_for_an_undo_is_422(api: Any, run: Any, prod_alerts: Any) -> None:
    action = _applied_action(run, 41)
    api.accepted_write(
        run.token, "patch", PROD_ALERTS, {"severity": "x"}, if_match='"42"', key="shared-key-0001"
    )
    response = api.undo(action.pk, token=run.token, key="shared-key-0001")
    assert response.status_code == 422
    assert json.loads(response.content)["code"] == "idempotency_key_reused"


def test_undo_keys_are_scoped_to_the_agent_or_the_person(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    first_action = _applied_action(run, 41)
    second_action = _applied_action(run, 42)
    assert api.undo(first_action.pk, token=operator.token, key="same-key-00001").status_code == 202
    response = api.undo(second_action.pk, token=run.token, key="same-key-00001")
    assert response.status_code == 202, response.content
    assert "Idempotent-Replayed" not in response
    assert undo_requests() == 2
    scopes = sorted(
        (r.agent_id is not None, r.person_id is not None)
        for r in IdempotencyRecord.objects.filter(key="same-key-00001")
    )
    assert scopes == [(False, True), (True, False)]


def test_a_refused_undo_releases_its_key(api: Any, run: Any, prod_alerts: Any) -> None:
    action = _applied_action(run, 41)
    Operation.objects.filter(action=action, undo_of__isnull=True).update(
        undo_deadline=timezone.now() - timedelta(seconds=1)
    )
    response = api.undo(action.pk, token=run.token, key="undo-key-expired")
    assert response.status_code == 409
    assert json.loads(response.content)["code"] == "undo_window_expired"
    assert not IdempotencyRecord.objects.filter(key="undo-key-expired").exists()
