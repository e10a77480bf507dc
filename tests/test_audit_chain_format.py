"""docs/audit-chain.md is the chain's format: the hashes of events appended by every path of
the server (one append, a batch, a deferred block, a guarded append), as the API and the
export serve them, recompute from the document's rules — implemented again here, from the
document, without audit.chain — and so does the document's worked example."""

from __future__ import annotations

import hashlib
import io
import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from audit.chain import canonical_json, event_hash, hashed_fields
from audit.services import Actor, audit_append, audit_append_if, audit_append_many, audit_deferred
from audit.verify import audit_head
from tests.conftest import ROOT

DOC = ROOT / "docs" / "audit-chain.md"
GENESIS = "0" * 64
# Section 2 of the document: the API's key → the hashed key.
HASHED = {
    "seq": "seq",
    "created_at": "created_at",
    "actor_type": "actor_type",
    "actor_id": "actor_id",
    "actor_label": "actor_label",
    "request_id": "request_id",
    "event_type": "event_type",
    "resource": "resource",
    "run": "run_id",
    "action": "action_id",
    "details": "details",
}
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00$")


def documented_hash(item: dict[str, Any]) -> str:
    """Section 3, from the text: SHA-256 of the UTF-8 canonical JSON of
    {"event": <the eleven hashed fields>, "prev_hash": <prev_hash>}."""
    fields = {hashed: item[key] for key, hashed in HASHED.items()}
    text = json.dumps(
        {"event": fields, "prev_hash": item["prev_hash"]},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def assert_chain_by_the_document(items: list[dict[str, Any]]) -> None:
    """Sections 4 and 5: from the genesis, seq + 1 and prev_hash = the previous hash each."""
    previous_seq, previous_hash = 0, GENESIS
    for item in sorted(items, key=lambda item: item["seq"]):
        assert item["seq"] == previous_seq + 1, item
        assert item["prev_hash"] == previous_hash, item
        assert TIME.match(item["created_at"]), item["created_at"]
        assert documented_hash(item) == item["hash"], item
        previous_seq, previous_hash = item["seq"], item["hash"]


def _doc_block(marker: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    after = text.split(f"<!-- example: {marker} -->", 1)[1]
    return after.strip().splitlines()


def test_the_documents_worked_example_is_what_the_server_hashes() -> None:
    lines = _doc_block("hash input")
    assert lines[0] == "```text" and lines[2] == "```"
    hash_input = lines[1]
    documented = _doc_block("hash")[0].strip("`")
    assert hashlib.sha256(hash_input.encode("utf-8")).hexdigest() == documented
    fields = hashed_fields(
        seq=1,
        created_at=datetime(2026, 12, 6, 3, 0, 0, tzinfo=UTC),
        actor_type="person",
        actor_id="7",
        actor_label="ana",
        request_id="req-1",
        event_type="write.applied",
        resource="notification-policy/prod-alerts",
        run_id=uuid.UUID("3f2c1e9a-0b1d-4c5e-8f6a-7b8c9d0e1f2a"),
        action_id=None,
        details={"version": 42, "note": "größer\n", "ratio": 0.5},
    )
    assert canonical_json({"event": fields, "prev_hash": GENESIS}) == hash_input
    assert event_hash(fields, GENESIS) == documented
    # Section 1's API item of the same event re-hashes to it too.
    item = json.loads(DOC.read_text(encoding="utf-8").split("```json", 1)[1].split("```")[0])
    assert item["hash"] == documented == documented_hash(item)


# Values that test the canonical form: sorting at depth, escapes, non-ASCII, numbers.
AWKWARD = {
    "z": [1, 2.5, -0.0001, 1e-07, 100.0, 12345678901234567890, True, None],
    "a": {
        "é": 'tab\tquote"back\\slash/ctl\x01\x1f',
        "B": "\u2028 \u2029 \x85 emoji \U0001f600 \x7f",
    },
    "nested": {"b": {"d": 1, "c": [{"y": 0, "x": ""}]}},
    "float_e16": 1e16,
    "nul": "a\x00b",
}


@pytest.mark.django_db
def test_events_of_every_append_path_rehash_by_the_documents_rules(
    monkeypatch: pytest.MonkeyPatch, api: Any, auditor: Any
) -> None:
    system = Actor.system("tests")
    run_id, action_id = uuid.uuid4(), uuid.uuid4()
    whole_second = datetime(2026, 12, 6, 3, 0, 0, tzinfo=UTC)
    with monkeypatch.context() as patched:
        patched.setattr(timezone, "now", lambda: whole_second)
        audit_append(event_type="test.whole_second", actor=system, details=AWKWARD)
        audit_append_many(
            [
                {"event_type": "test.batch", "actor": system, "details": {"n": n}, "run_id": run_id}
                for n in range(3)
            ]
        )
    audit_append(
        event_type="test.one",
        actor=Actor("person", "7", "ana"),
        resource="notification-policy/prod-alerts",
        run_id=run_id,
        action_id=action_id,
        request_id="req-1",
        details=AWKWARD,
    )
    with transaction.atomic(), audit_deferred():
        for n in range(2):
            audit_append(event_type="test.deferred", actor=system, details={"n": n, "f": 0.5})
    guarded = audit_append_if("%s", [True], event_type="test.guarded", actor=system, details={})
    assert guarded is not None
    with connection.cursor() as cursor:
        cursor.execute(guarded.sql, guarded.params)
        assert guarded.appended(cursor.fetchone()) is not None

    page = json.loads(api.get("/api/v1/audit?limit=200", token=auditor.token).content)
    items = page["items"]
    assert page["next"] is None and len(items) == audit_head()[0] >= 9
    whole = [item for item in items if item["event_type"] == "test.whole_second"]
    assert whole[0]["created_at"] == "2026-12-06T03:00:00.000000+00:00"
    assert_chain_by_the_document(items)
    out = io.StringIO()
    call_command("audit_export", jsonl=True, stdout=out, stderr=io.StringIO())
    exported = [json.loads(line) for line in out.getvalue().splitlines()]
    assert exported == sorted(items, key=lambda item: item["seq"])
    assert_chain_by_the_document(exported)
