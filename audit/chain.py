"""Hashing and verification of the audit chain: pure functions, no database."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

GENESIS_HASH = "0" * 64

# The stored columns an event's hash covers (with prev_hash), in hashed_fields' order.
HASHED_COLUMNS = (
    "seq",
    "created_at",
    "actor_type",
    "actor_id",
    "actor_label",
    "request_id",
    "event_type",
    "resource",
    "run_id",
    "action_id",
    "details",
)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def hashed_time(moment: datetime) -> str:
    """An event's time as hashed, and as the API and the export show it: UTC, always six
    digits of microseconds (`2026-12-06T03:54:24.000000+00:00`; `isoformat()` alone drops
    them when they are zero)."""
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
        "created_at": hashed_time(created_at),
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


def system_event_fields(
    *,
    seq: int,
    created_at: datetime,
    label: str,
    event_type: str,
    details: dict[str, Any],
    resource: str = "",
) -> dict[str, Any]:
    """The hashed fields of a system event with no run, action or request id, for rows
    written without audit_append: the bench's bulk seed, tests that forge rows."""
    return hashed_fields(
        seq=seq,
        created_at=created_at,
        actor_type="system",
        actor_id="",
        actor_label=label,
        request_id="",
        event_type=event_type,
        resource=resource,
        run_id=None,
        action_id=None,
        details=details,
    )


def _row_hash(row: Any) -> str:
    fields = hashed_fields(**{name: getattr(row, name) for name in HASHED_COLUMNS})
    return event_hash(fields, row.prev_hash)


@dataclass(frozen=True)
class VerifyResult:
    """`events`: the last verified seq (the chain is whole up to it); `walked`: rows read."""

    ok: bool
    events: int
    first_bad_seq: int | None
    head_hash: str
    problem: str = ""
    walked: int = 0


def verify_rows(
    rows: Iterable[Any], *, after_seq: int = 0, after_hash: str = GENESIS_HASH
) -> VerifyResult:
    """Walk linked rows in seq order from a verified point (the genesis by default);
    report the first seq whose link or hash is wrong.

    Detects edits (hash mismatch), deletions and insertions (broken prev_hash link) and
    reordering (broken link). The numbers may have holes — an append that rolled back drew
    a seq no event keeps — so the links, not contiguous numbers, show that nothing is missing.
    `events` is the last verified seq.
    """
    last_seq, expected_prev, walked = after_seq, after_hash, 0
    problem, first_bad = "", None
    for row in rows:
        walked += 1
        if row.seq <= last_seq:
            first_bad, problem = row.seq, "seq out of order"
        elif row.prev_hash != expected_prev:
            first_bad, problem = row.seq, "broken link"
        elif _row_hash(row) != row.hash:
            first_bad, problem = row.seq, "hash mismatch"
        if first_bad is not None:
            break
        expected_prev = row.hash
        last_seq = row.seq
    return VerifyResult(first_bad is None, last_seq, first_bad, expected_prev, problem, walked)


def against_head(result: VerifyResult, *, head_seq: int, head_hash: str) -> VerifyResult:
    """A walk that verified is still broken if it does not end exactly at the head
    row (a deleted tail, or a head row moved by hand)."""
    if not result.ok or (head_seq, head_hash) == (result.events, result.head_hash):
        return result
    return replace(
        result,
        ok=False,
        first_bad_seq=min(head_seq, result.events) + 1,
        problem=f"head row says #{head_seq} {head_hash[:12]}…, the chain ends at "
        f"#{result.events} {result.head_hash[:12]}…",
    )
