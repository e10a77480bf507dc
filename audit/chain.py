"""Hashing and verification of the audit chain (pure functions plus one walk)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

GENESIS_HASH = "0" * 64


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def normalise_time(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def event_hash(fields: dict[str, Any], prev_hash: str) -> str:
    """SHA-256 over the canonical JSON of the event's fields and the previous hash."""
    payload = canonical_json({"event": fields, "prev_hash": prev_hash})
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def hashed_fields(
    *,
    seq: int,
    created_at: datetime,
    actor_type: str,
    actor_id: str,
    actor_label: str,
    request_id: str,
    event_type: str,
    resource: str,
    run_id: Any,
    action_id: Any,
    details: dict[str, Any],
) -> dict[str, Any]:
    return {
        "seq": seq,
        "created_at": normalise_time(created_at),
        "actor_type": actor_type,
        "actor_id": actor_id,
        "actor_label": actor_label,
        "request_id": request_id,
        "event_type": event_type,
        "resource": resource,
        "run_id": str(run_id) if run_id else None,
        "action_id": str(action_id) if action_id else None,
        "details": details,
    }


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    events: int
    first_bad_seq: int | None
    head_hash: str
    problem: str = ""


def verify_rows(rows: Iterable[Any]) -> VerifyResult:
    """Walk rows in seq order; report the first seq whose link or hash is wrong.

    Detects edits (hash mismatch), deletions and insertions (seq gap or broken
    prev_hash link) and reordering (prev_hash link).
    """
    expected_prev = GENESIS_HASH
    expected_seq = 1
    count = 0
    for row in rows:
        count += 1
        if row.seq != expected_seq:
            return VerifyResult(False, count - 1, expected_seq, expected_prev, "seq gap")
        if row.prev_hash != expected_prev:
            return VerifyResult(False, count - 1, row.seq, expected_prev, "broken link")
        fields = hashed_fields(
            seq=row.seq,
            created_at=row.created_at,
            actor_type=row.actor_type,
            actor_id=row.actor_id,
            actor_label=row.actor_label,
            request_id=row.request_id,
            event_type=row.event_type,
            resource=row.resource,
            run_id=row.run_id,
            action_id=row.action_id,
            details=row.details,
        )
        if event_hash(fields, row.prev_hash) != row.hash:
            return VerifyResult(False, count - 1, row.seq, expected_prev, "hash mismatch")
        expected_prev = row.hash
        expected_seq += 1
    return VerifyResult(True, count, None, expected_prev)
