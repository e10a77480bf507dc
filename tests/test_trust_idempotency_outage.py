"""A request that loses the database after claiming its Idempotency-Key cannot release the
key; its retry must not then answer 409 `idempotency_key_in_flight` until the in-flight
window (a minute) ends. Found by tests/test_deploy_pg_restart.py in CI: the one write in
flight when PostgreSQL restarted was never accepted by its client's minute of retries.

The database really goes away under the request: its session is terminated on the server
(as a restart does) between the claim and the release."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import DatabaseError, connection

from approvals.models import IdempotencyRecord, IdempotencyStatus
from approvals.outbox import engine_redis
from approvals.services import idempotency
from audit.services import Actor
from tests.fixtures.api import ensure_api_kinds, make_agent_with_token

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "/api/v1/resources/dns-record/outage-w0"
KEY = "key-outage-0001"
FINGERPRINT = idempotency.request_fingerprint(method="PUT", path=PATH, body=b'{"n": 0}')


@pytest.fixture
def actor() -> Iterator[Actor]:
    ensure_api_kinds()
    engine_redis().delete(idempotency.ABANDONED_KEY)
    yield Actor.agent(make_agent_with_token("outage-bot").agent)
    engine_redis().delete(idempotency.ABANDONED_KEY)


def _claim(actor: Actor) -> idempotency.Begin:
    return idempotency.idempotency_begin(
        actor=actor, key=KEY, method="PUT", path=PATH, fingerprint=FINGERPRINT
    )


def _lose_the_database() -> None:
    """End this connection's session on the server, as a PostgreSQL restart does."""
    with pytest.raises(DatabaseError), connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


def test_a_key_whose_request_lost_the_database_is_free_for_its_retry_at_once(
    actor: Actor,
) -> None:
    first = _claim(actor)
    assert first.record_id is not None
    _lose_the_database()
    idempotency.idempotency_release(record_id=first.record_id)  # no database: noted instead
    connection.close()  # the retry comes on a new connection
    held = IdempotencyRecord.objects.get(pk=first.record_id)
    assert held.status == IdempotencyStatus.IN_FLIGHT  # the release never reached PostgreSQL

    retry = _claim(actor)

    assert retry.replay is None and retry.record_id not in (None, first.record_id)
    assert not IdempotencyRecord.objects.filter(pk=first.record_id).exists()


def test_a_noted_record_that_its_request_completed_is_replayed_not_freed(actor: Actor) -> None:
    first = _claim(actor)
    assert first.record_id is not None
    stored = idempotency.StoredResponse(status=202, headers={}, body=b'{"id": "x"}')
    idempotency.idempotency_complete(record_id=first.record_id, response=stored)
    idempotency._note_abandoned(first.record_id)  # say its release was noted too

    retry = _claim(actor)

    assert retry.record_id is None and retry.replay == stored
    assert IdempotencyRecord.objects.filter(pk=first.record_id).exists()


def test_a_request_still_in_flight_keeps_its_key(actor: Actor) -> None:
    first = _claim(actor)
    assert first.record_id is not None
    with pytest.raises(idempotency.IdempotencyKeyError) as refused:
        _claim(actor)
    assert refused.value.code == "idempotency_key_in_flight"
    assert IdempotencyRecord.objects.filter(pk=first.record_id).exists()
