"""A request that loses the database after claiming its Idempotency-Key cannot release the
key; its retry must not then answer 409 `idempotency_key_in_flight` until the in-flight
window (a minute) ends. Found by tests/test_deploy_pg_restart.py in CI: the one write in
flight when PostgreSQL restarted was never accepted by its client's minute of retries.

The database really goes away under the request: its session is terminated on the server
(as a restart does) between the claim and the release; or the claim's COMMIT reaches the
server and its answer never comes back (a relay cuts the connection there)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

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


def _assert_the_retry_frees(actor: Actor, held: IdempotencyRecord) -> None:
    """`held` is still in flight; the retry deletes it and gets a claim of its own."""
    assert held.status == IdempotencyStatus.IN_FLIGHT

    retry = _claim(actor)

    assert retry.replay is None and retry.record_id not in (None, held.pk)
    assert not IdempotencyRecord.objects.filter(pk=held.pk).exists()


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
    # The release never reached PostgreSQL, yet the retry claims the key at once.
    _assert_the_retry_frees(actor, IdempotencyRecord.objects.get(pk=first.record_id))


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


# CommandComplete of what made the claim durable: "COMMIT" of a transaction, or the claim's
# own "INSERT 0 1" (one statement in autocommit: the server commits it before answering).
COMMIT_DONE = (b"C\x00\x00\x00\x0bCOMMIT\x00", b"C\x00\x00\x00\x0fINSERT 0 1\x00")


class CommitAnswerEater:
    """A TCP relay to PostgreSQL that, once armed, cuts the client off at the server's
    answer to COMMIT instead of passing it on: the transaction committed on the server
    and the client never learns it."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.armed = threading.Event()
        self.ate = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        tail = b""
        try:
            while chunk := source.recv(65536):
                seen = tail + chunk
                if answers and self.armed.is_set() and any(done in seen for done in COMMIT_DONE):
                    self.ate.set()
                    break
                tail = seen[-max(len(done) for done in COMMIT_DONE) :]
                sink.sendall(chunk)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def through_the_eater() -> Iterator[CommitAnswerEater]:
    """This test's connection to PostgreSQL goes through the relay (without TLS, so the
    relay can read the answers) until the test ends."""
    original = dict(connection.settings_dict)
    eater = CommitAnswerEater(original["HOST"] or "127.0.0.1", int(original["PORT"] or 5432))
    connection.close()
    connection.settings_dict.update(
        HOST="127.0.0.1",
        PORT=str(eater.port),
        OPTIONS={**original.get("OPTIONS", {}), "sslmode": "disable"},
    )
    yield eater
    connection.close()
    connection.settings_dict.clear()
    connection.settings_dict.update(original)
    eater.close()


def test_a_claim_whose_commit_answer_was_lost_is_free_for_its_retry_at_once(
    actor: Actor, through_the_eater: CommitAnswerEater
) -> None:
    """The claim commits on the server, but the request hears only a dropped connection:
    it never learns its record's id, so it notes the claim by its key and stamp."""
    assert connection.vendor == "postgresql"
    through_the_eater.armed.set()
    with pytest.raises(DatabaseError):
        _claim(actor)
    assert through_the_eater.ate.is_set()
    through_the_eater.armed.clear()
    connection.close()
    # It did commit, yet the retry claims the key at once.
    _assert_the_retry_frees(actor, IdempotencyRecord.objects.get(agent_id=actor.id, key=KEY))


def test_a_note_names_only_its_own_claim(actor: Actor) -> None:
    """A note for a claim stamped at one moment never frees the key's later claim."""
    first = _claim(actor)
    assert first.record_id is not None
    held = IdempotencyRecord.objects.get(pk=first.record_id)
    scope = {"agent_id": held.agent_id}
    idempotency._note_abandoned_claim(scope, KEY, held.created_at - timedelta(microseconds=1))

    with pytest.raises(idempotency.IdempotencyKeyError) as refused:
        _claim(actor)

    assert refused.value.code == "idempotency_key_in_flight"
    idempotency._note_abandoned_claim(scope, KEY, held.created_at)
    assert _claim(actor).record_id not in (None, first.record_id)
