"""Idempotency keys: one record per agent (or person) + key, bound to a request
fingerprint.

Writes and a run token's undo scope keys to the agent; a personal token's undo
to the person. The first request with a key inserts an `in_flight` record in
its own short transaction; the unique constraint decides races, so of N
concurrent identical requests exactly one goes on to record an action. The
winner completes the record with the response it sent, in the same
transaction as the action, and later requests replay it byte for byte.

A request that stalls past the in-flight window may be taken over by a retry;
completing then finds its record gone and raises, rolling the stalled
request's transaction back: exactly one action per key, whichever commits.

Only answers that are the decision about the write are stored (202 accepted,
412 refused stale); anything else releases the key. 409/429/503 are never
stored.

A request that fails because the database went away (a restart, a failover) cannot
release its key either: the release is then noted in Redis (ABANDONED_KEY), and the
retry that finds the record still in flight frees it at once instead of answering 409
until the in-flight window ends — a minute of 409s after every outage otherwise. A claim
whose COMMIT lost its answer (it may or may not have committed) is noted the same way,
by its key and creation stamp, since its id never came back.

`POST /runs` takes a key too (optional there): its answer carries the run's token, which
is never stored readable — the stored body leaves it out and keeps it sealed
(`secret_seal`: Fernet under a key derived from SECRET_KEY), so a replay hands back the
same token and a copy of the database alone reveals none.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone
from redis.exceptions import RedisError

from approvals.models import IdempotencyRecord, IdempotencyStatus
from approvals.outbox import engine_redis
from audit.models import ActorType
from audit.services import Actor
from console.compiled_query import CompiledInsert, CompiledUpdate
from engine.core import jsonsafe
from engine.core.errors import DomainError

KEY_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{8,255}$")
# An in-flight record older than this belongs to a request that died mid-way;
# a new request may take the key over.
IN_FLIGHT_ABANDONED_AFTER = timedelta(seconds=60)
IN_FLIGHT_RETRY_AFTER_SECONDS = 1
NEVER_STORED = frozenset({409, 429, 503})
# In-flight records whose request ended without being able to release them (the database
# was unreachable): by id ("record:<id>"), or, for a claim whose COMMIT lost its answer, by
# its claim (_claim_member). Kept past the in-flight window, after which the window frees them.
ABANDONED_KEY = "airlock:idempotency:abandoned"
ABANDONED_TTL_SECONDS = int(IN_FLIGHT_ABANDONED_AFTER.total_seconds()) * 2

# A key's claim: one INSERT that skips a key already held (its unique constraint).
_CLAIM = CompiledInsert(IdempotencyRecord, skip_conflicts=True)
# Its answer stored, by the request that holds it (in the transaction that made it).
_COMPLETE = CompiledUpdate(
    IdempotencyRecord,
    columns=("status", "response_status", "response_headers", "response_body", "action_id"),
    where=("id", "status"),
)

log = logging.getLogger("airlock.idempotency")


class IdempotencyKeyError(DomainError):
    pass


@dataclass(frozen=True)
class StoredResponse:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Begin:
    """Either a fresh in-flight record to complete, or a response to replay."""

    record_id: int | None
    replay: StoredResponse | None


def key_check(raw: str | None) -> str:
    if raw is None or raw == "":
        raise IdempotencyKeyError(
            "Writes need an Idempotency-Key header.", code="idempotency_key_missing"
        )
    if not KEY_PATTERN.match(raw):
        raise IdempotencyKeyError(
            "Idempotency-Key must match [A-Za-z0-9._:-]{8,255}.", code="idempotency_key_invalid"
        )
    return raw


def optional_key_check(raw: str | None) -> str | None:
    """An optional Idempotency-Key (POST /runs): None when the header is absent; a
    present one must be well formed (an empty one included)."""
    if raw is None:
        return None
    if not KEY_PATTERN.match(raw):
        raise IdempotencyKeyError(
            "Idempotency-Key must match [A-Za-z0-9._:-]{8,255}.", code="idempotency_key_invalid"
        )
    return raw


def canonical_body_hash(body: bytes) -> str:
    """Hash of the body's canonical JSON (key order and spacing do not matter)."""
    if not body:
        return hashlib.sha256(b"").hexdigest()
    try:
        parsed = jsonsafe.loads(body)
    except DomainError:
        return hashlib.sha256(body).hexdigest()
    canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def request_fingerprint(*, method: str, path: str, body: bytes) -> str:
    material = f"{method.upper()}\n{path}\n{canonical_body_hash(body)}"
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


def _key_scope(actor: Actor) -> dict[str, Any]:
    if actor.type == ActorType.AGENT and actor.id:
        return {"agent_id": actor.id}
    if actor.type == ActorType.PERSON and actor.id.isdigit():
        return {"person_id": int(actor.id)}
    raise ValueError("an idempotency key belongs to an agent or a person")


def idempotency_begin(
    *,
    actor: Actor,
    key: str,
    method: str,
    path: str,
    fingerprint: str,
) -> Begin:
    """Claim `key` for this request or find what it already produced.

    `actor` is whom the key belongs to: an agent (writes, and a run token's undo:
    pass the run's agent, so a key outlives the run) or a person (a personal
    token's undo); ValueError for anyone else.
    Raises idempotency_key_reused (422) when the key was used for a different
    request, idempotency_key_in_flight (409, retryable) while the first
    request with it is still being processed.
    """
    scope = _key_scope(actor)
    now = timezone.now()
    # +1 s so `expires_at - created_at` (created_at is stamped a moment later) is
    # never under the configured retention.
    retention = timedelta(seconds=settings.AIRLOCK_IDEMPOTENCY_RETENTION_SECONDS + 1)
    for _attempt in range(3):
        record = IdempotencyRecord(
            **scope,
            key=key,
            fingerprint=fingerprint,
            method=method.upper(),
            path=path[:1024],
            status=IdempotencyStatus.IN_FLIGHT,
            expires_at=now + retention,
        )
        try:
            # One statement (autocommit: it commits alone): a key another request holds
            # already is skipped, not an IntegrityError to catch in a savepoint.
            if _CLAIM.insert(record):
                return Begin(record_id=record.pk, replay=None)
        except DatabaseError:
            # The claim may have committed with its answer lost (the connection dropped
            # after the server committed the INSERT): this request goes no further, so its
            # record, if any, is noted as abandoned — by what it was stamped with, its id
            # being unknown.
            if record.created_at is not None:
                _note_abandoned_claim(scope, key, record.created_at)
            raise
        existing = IdempotencyRecord.objects.filter(**scope, key=key).first()
        if existing is None:
            continue  # released or pruned between our insert and read: try again
        if existing.expires_at <= now:
            # Past retention but not pruned yet: the key is free again.
            IdempotencyRecord.objects.filter(pk=existing.pk, expires_at__lte=now).delete()
            continue
        if existing.fingerprint != fingerprint:
            raise IdempotencyKeyError(
                "This Idempotency-Key was already used for a different request "
                "(method, path or body differ).",
                code="idempotency_key_reused",
            )
        if existing.status == IdempotencyStatus.DONE:
            return Begin(
                record_id=None,
                replay=StoredResponse(
                    status=int(existing.response_status or 200),
                    headers=dict(existing.response_headers or {}),
                    body=bytes(existing.response_body or b""),
                ),
            )
        if existing.created_at < now - IN_FLIGHT_ABANDONED_AFTER or _abandoned(scope, existing):
            IdempotencyRecord.objects.filter(
                pk=existing.pk, status=IdempotencyStatus.IN_FLIGHT, created_at=existing.created_at
            ).delete()
            continue
        raise IdempotencyKeyError(
            "A request with this Idempotency-Key is still being processed.",
            code="idempotency_key_in_flight",
            retryable=True,
            extra={"retry_after": IN_FLIGHT_RETRY_AFTER_SECONDS},
        )
    raise IdempotencyKeyError(
        "A request with this Idempotency-Key is still being processed.",
        code="idempotency_key_in_flight",
        retryable=True,
        extra={"retry_after": IN_FLIGHT_RETRY_AFTER_SECONDS},
    )


def idempotency_complete(
    *, record_id: int, response: StoredResponse, action_id: Any = None
) -> bool:
    """Store the response for replay. Call inside the transaction that made it.

    Raises IdempotencyKeyError idempotency_key_in_flight (409, retryable) when
    this request's in-flight record is gone: a retry took the key over after
    the in-flight window (the original stalled). The caller's transaction then
    rolls back, so of the original and the takeover exactly one records an
    action; the original's client retries and gets the winner's answer.
    """
    if response.status in NEVER_STORED or response.status >= 500:
        idempotency_release(record_id=record_id)
        return False
    updated = _COMPLETE.update(
        columns={
            "status": IdempotencyStatus.DONE,
            "response_status": response.status,
            "response_headers": response.headers,
            "response_body": response.body,
            "action_id": action_id,
        },
        where={"id": record_id, "status": IdempotencyStatus.IN_FLIGHT},
    )
    if not updated:
        raise IdempotencyKeyError(
            "This request stalled past the in-flight window and a retry with the same "
            "Idempotency-Key took over; nothing was recorded by this one. Send it again "
            "to get the retry's answer.",
            code="idempotency_key_in_flight",
            retryable=True,
            extra={"retry_after": IN_FLIGHT_RETRY_AFTER_SECONDS},
        )
    return True


def idempotency_release(*, record_id: int) -> None:
    """Free the key: the request ended without a decision worth replaying. Where the
    database cannot be reached, the release is noted for the key's next request instead
    (ABANDONED_KEY) and the caller's own error stays the answer."""
    try:
        IdempotencyRecord.objects.filter(pk=record_id, status=IdempotencyStatus.IN_FLIGHT).delete()
    except DatabaseError:
        log.warning("could not release idempotency record %s; noting it", record_id)
        _note_abandoned(record_id)


def _note_abandoned(record_id: int) -> None:
    _note(f"record:{record_id}")


def _note_abandoned_claim(scope: dict[str, Any], key: str, created_at: datetime) -> None:
    _note(_claim_member(scope, key, created_at))


def _claim_member(scope: dict[str, Any], key: str, created_at: datetime) -> str:
    """A claim's name before its id is known: whose key, which key, stamped when (a key
    claimed again later is stamped later, so a note never names its successor)."""
    ((owner, owner_id),) = scope.items()
    stamp = created_at.astimezone(UTC).isoformat()
    material = f"{owner}={owner_id}\n{key}\n{stamp}"
    return "claim:" + hashlib.sha256(material.encode("utf-8")).hexdigest()


def _note(member: str) -> None:
    try:
        pipe = engine_redis().pipeline()
        pipe.sadd(ABANDONED_KEY, member)
        pipe.expire(ABANDONED_KEY, ABANDONED_TTL_SECONDS)
        pipe.execute()
    except RedisError:
        log.warning("could not note an abandoned idempotency claim; the in-flight window frees it")


def _abandoned(scope: dict[str, Any], record: IdempotencyRecord) -> bool:
    """Did the request that holds this in-flight record end without releasing it (noted by
    its id), or without learning it had claimed it (noted by its claim)? Only a record
    still in flight is ever deleted for it: one its request completed stays."""
    try:
        pipe = engine_redis().pipeline(transaction=False)
        pipe.sismember(ABANDONED_KEY, f"record:{record.pk}")
        pipe.sismember(ABANDONED_KEY, _claim_member(scope, record.key, record.created_at))
        return any(pipe.execute())
    except RedisError:
        return False


def idempotency_prune(*, now: datetime | None = None) -> int:
    """Delete records past their retention (>= 24 h). Scheduled by housekeeping."""
    deleted, _ = IdempotencyRecord.objects.filter(expires_at__lte=now or timezone.now()).delete()
    return int(deleted)


# --- Secrets inside a stored answer ------------------------------------------------------


def _sealer() -> MultiFernet:
    """Fernet keys derived from SECRET_KEY, then each of SECRET_KEY_FALLBACKS (so a
    rotated key still opens what it sealed within the retention)."""
    secrets = [settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS]
    keys = [
        base64.urlsafe_b64encode(
            hashlib.sha256(b"airlock.idempotency.seal\n" + str(secret).encode("utf-8")).digest()
        )
        for secret in secrets
    ]
    return MultiFernet([Fernet(key) for key in keys])


def secret_seal(secret: str) -> str:
    """`secret` encrypted and authenticated, to keep inside a stored answer."""
    return _sealer().encrypt(secret.encode("utf-8")).decode("ascii")


def secret_unseal(sealed: str) -> str | None:
    """What `secret_seal` sealed; None when no current or fallback SECRET_KEY opens it."""
    try:
        return _sealer().decrypt(sealed.encode("ascii")).decode("utf-8")
    except (InvalidToken, ValueError):
        return None
