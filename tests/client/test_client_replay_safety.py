"""What the client resends, against a live Airlock behind a real relay that loses or
replaces answers: a request is resent after something that may have followed COMMIT (a
503, a cut connection, a read timeout) only when the server would replay its first answer
(an Idempotency-Key, as every create_run now sends); a lost run creation, retried,
creates exactly one run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from airlock_client import Airlock, TransportFailed, Unavailable
from airlock_client import _protocol as protocol

from approvals.models import Run
from tests.client.conftest import POLICY_WRITE_SET, Live
from tests.client.proxy import DroppingProxy
from tests.client.relay import Mode, Relay
from tests.fixtures.api import make_agent_with_token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

RUNS = "/api/v1/runs"


@pytest.fixture
def agent(live_without_worker: Live) -> Any:
    return make_agent_with_token("replay-bot")


def relay_for(live: Live, mode: Mode, hold: float = 0.0) -> Iterator[Relay]:
    relay = Relay(live.url, method="POST", prefix=RUNS, mode=mode, hold=hold)
    try:
        yield relay
    finally:
        relay.close()


@pytest.fixture
def after_commit_503(live_without_worker: Live) -> Iterator[Relay]:
    yield from relay_for(live_without_worker, "503_after")


@pytest.fixture
def slow_answer(live_without_worker: Live) -> Iterator[Relay]:
    yield from relay_for(live_without_worker, "slow_after", hold=3.0)


@pytest.fixture
def refused_first(live_without_worker: Live) -> Iterator[Relay]:
    yield from relay_for(live_without_worker, "429_before")


def runs_of(agent: Any) -> list[str]:
    return [str(pk) for pk in Run.objects.filter(agent=agent.agent).values_list("pk", flat=True)]


def keys_sent(relay: Relay) -> set[str]:
    return {h.get("Idempotency-Key", "") for m, p, h in relay.seen if m == "POST" and p == RUNS}


def keyless_run_create(token: str) -> protocol.Op[httpx.Response]:
    """POST /runs without an Idempotency-Key: the server cannot replay it."""
    body = json.dumps(
        {"task": "no key", "write_set": [{"resource": "dns-record/x-*", "operations": ["create"]}]}
    )
    headers = {"Content-Type": "application/json"}
    call = protocol.Call("POST", RUNS, token, headers, body.encode(), replay_safe=False)
    return (yield call)


def test_a_run_creation_answered_503_after_commit_is_resent_with_its_key_and_makes_one_run(
    after_commit_503: Relay, agent: Any
) -> None:
    with Airlock(after_commit_503.url, agent.token) as airlock:
        session = airlock.start_run("one run only", POLICY_WRITE_SET, approval_timeout=0)
    assert after_commit_503.tampered == 1  # the first answer was the 503, after the commit
    assert after_commit_503.count("POST", RUNS) == 2
    assert len(keys_sent(after_commit_503)) == 1  # the retry was the identical request
    assert runs_of(agent) == [session.id]
    whoami = httpx.get(
        f"{after_commit_503.url}/api/v1/whoami",
        headers={"Authorization": f"Bearer {session.token}"},
    )
    assert whoami.json()["principal"] == "run"  # the replayed token is the run's


def test_a_run_creation_whose_answer_was_lost_is_resent_and_makes_one_run(
    live_without_worker: Live, agent: Any
) -> None:
    proxy = DroppingProxy(live_without_worker.url, drop_first=b"POST ")
    try:
        with Airlock(proxy.url, agent.token) as airlock:
            session = airlock.start_run("one run only", POLICY_WRITE_SET, approval_timeout=0)
        assert proxy.dropped == 1 and proxy.requests_seen(b"POST ") == 2
        assert runs_of(agent) == [session.id]
    finally:
        proxy.close()


def test_a_run_creation_answered_after_the_read_timeout_is_resent_and_makes_one_run(
    slow_answer: Relay, agent: Any
) -> None:
    with Airlock(slow_answer.url, agent.token, timeout=1.0) as airlock:
        session = airlock.start_run("one run only", POLICY_WRITE_SET, approval_timeout=0)
    assert slow_answer.count("POST", RUNS) >= 2 and len(keys_sent(slow_answer)) == 1
    assert runs_of(agent) == [session.id]


def test_a_post_without_a_key_answered_503_after_commit_is_not_resent(
    after_commit_503: Relay, agent: Any
) -> None:
    with Airlock(after_commit_503.url, agent.token) as airlock, pytest.raises(Unavailable):
        airlock._run(keyless_run_create(agent.token))
    assert after_commit_503.count("POST", RUNS) == 1
    assert len(runs_of(agent)) == 1  # it had happened: a resend would have made a second


def test_a_post_without_a_key_is_not_resent_after_a_read_timeout(
    slow_answer: Relay, agent: Any
) -> None:
    refused = pytest.raises(TransportFailed, match="may or may not have taken effect")
    with Airlock(slow_answer.url, agent.token, timeout=1.0) as airlock, refused:
        airlock._run(keyless_run_create(agent.token))
    assert slow_answer.count("POST", RUNS) == 1
    assert len(runs_of(agent)) == 1


def test_a_post_without_a_key_refused_before_acting_is_resent(
    refused_first: Relay, agent: Any
) -> None:
    with Airlock(refused_first.url, agent.token) as airlock:
        response = airlock._run(keyless_run_create(agent.token))
    assert response.status_code == 201
    assert refused_first.count("POST", RUNS) == 2
    assert len(runs_of(agent)) == 1
