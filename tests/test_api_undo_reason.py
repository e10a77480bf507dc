"""`POST /actions/{id}/undo` takes `Airlock-Reason` (a person's token or the run's): kept
on the undo and in `undo.requested`; too long is a 400 that changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Operation
from audit.models import AuditEvent
from tests.fixtures.api import problem
from tests.fixtures.core import applied_prod_alerts_action

pytestmark = pytest.mark.django_db


def test_a_personal_tokens_undo_keeps_its_reason(
    api: Any, run: Any, operator: Any, prod_alerts: Any
) -> None:
    action = applied_prod_alerts_action(run.run)
    url = f"/api/v1/actions/{action.pk}/undo"
    refused = api.post(
        url,
        token=operator.token,
        headers={"Idempotency-Key": "undo-reason-0001", "Airlock-Reason": "y" * 501},
    )
    problem(refused, 400, "bad_header")
    assert not Operation.objects.filter(action=action, undo_of__isnull=False).exists()

    accepted = api.post(
        url,
        token=operator.token,
        headers={"Idempotency-Key": "undo-reason-0002", "Airlock-Reason": "wrong channel"},
    )
    assert accepted.status_code == 202, accepted.content
    undo = Operation.objects.get(action=action, undo_of__isnull=False)
    assert (undo.outcome or {})["requested_reason"] == "wrong channel"
    assert (undo.outcome or {})["requested_by_type"] == "person"
    event = AuditEvent.objects.get(event_type="undo.requested", action_id=action.pk)
    assert event.details["reason"] == "wrong channel" and event.actor_type == "person"


def test_an_undo_without_a_reason_records_none(api: Any, run: Any, prod_alerts: Any) -> None:
    action = applied_prod_alerts_action(run.run)
    assert api.undo(action.pk, token=run.token, key="undo-reason-0003").status_code == 202
    event = AuditEvent.objects.get(event_type="undo.requested", action_id=action.pk)
    assert "reason" not in event.details
