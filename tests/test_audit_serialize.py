"""One representation of an audit event: the API's items, the JSON Lines export and
the OpenAPI schema agree (the contract's `run`/`action` keys won over `run_id`)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from audit.services import Actor, audit_append
from tests.fixtures.console import client_for
from tests.test_audit_chain_format import documented_hash

pytestmark = pytest.mark.django_db


def _schema_keys(api: Any, name: str) -> set[str]:
    document = json.loads(api.get("/api/v1/openapi.json").content)
    return set(document["components"]["schemas"][name]["properties"])


def test_an_exported_line_is_the_api_item_of_the_same_event(api: Any, auditor: Any) -> None:
    run_id, action_id = uuid.uuid4(), uuid.uuid4()
    event = audit_append(
        event_type="write.applied",
        actor=Actor.system("tests"),
        resource="notification-policy/prod-alerts",
        run_id=run_id,
        action_id=action_id,
        details={"version": 2, "note": "ünïcode"},
    )
    listed = json.loads(
        api.get(f"/api/v1/audit?run={run_id}", token=auditor.token).content.decode()
    )
    export: Any = client_for(auditor.user).get(f"/audit/export.jsonl?run={run_id}")
    lines = b"".join(export.streaming_content).decode().splitlines()
    assert len(lines) == 1 and len(listed["items"]) == 1
    item, line = listed["items"][0], json.loads(lines[0])
    assert line == item
    assert set(item) == _schema_keys(api, "AuditEventOut")
    assert item["run"] == str(run_id) and item["action"] == str(action_id)
    stored = AuditEvent.objects.get(seq=event.seq)  # linked when the API served it
    assert item["seq"] == event.seq and item["hash"] == stored.hash != ""


def test_an_event_on_a_whole_second_is_served_with_what_was_hashed(
    monkeypatch: pytest.MonkeyPatch, api: Any, auditor: Any
) -> None:
    """created_at is served as hashed: six microsecond digits even when they are zero (the API
    and the export once showed `…T03:00:00+00:00`, and such an event did not re-hash)."""
    with monkeypatch.context() as patched:
        patched.setattr(timezone, "now", lambda: datetime(2026, 12, 6, 3, 0, 0, tzinfo=UTC))
        event = audit_append(event_type="test.whole_second", actor=Actor.system("tests"))
    listed = json.loads(
        api.get("/api/v1/audit?event_type=test.whole_second", token=auditor.token).content
    )
    export: Any = client_for(auditor.user).get("/audit/export.jsonl?type=test.whole_second")
    line = json.loads(b"".join(export.streaming_content))
    for item in (listed["items"][0], line):
        assert item["created_at"] == "2026-12-06T03:00:00.000000+00:00"
        stored = AuditEvent.objects.get(seq=event.seq)  # linked when the API served it
        assert item["seq"] == event.seq and documented_hash(item) == item["hash"] == stored.hash
