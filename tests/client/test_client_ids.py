"""An id or a resource name chosen by someone else (a model) never reaches another
endpoint: every method that takes one refuses a non-UUID id, or a kind/name that is not
one path segment, with InvalidIdentifier before anything is sent; a name with `?`, `/` or
`%` is sent quoted, as one segment. Against a live Airlock behind a recording relay."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from airlock_client import (
    Airlock,
    AsyncAirlock,
    InvalidIdentifier,
    NotFound,
    ProblemError,
    RunSession,
)
from airlock_client.models import Resource, Run

from tests.client.conftest import Live
from tests.client.relay import Relay
from tests.fixtures.api import make_active_run, make_agent_with_token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BAD_IDS = [
    "../../agents",
    "x?y",
    "..",
    ".",
    "",
    "00000000-0000-4000-8000-000000000001/../../agents",
    "00000000-0000-4000-8000-000000000001?run=x",
    "%2e%2e",
]
BAD_RESOURCES = [
    "../../agents",
    "notification-policy/..",
    "notification-policy/.",
    "./prod-alerts",
    "no-slash",
    "/prod-alerts",
    "notification-policy/",
]


@pytest.fixture
def relay(live_without_worker: Live) -> Iterator[Relay]:
    # Never tampers (no request is a NONE): it only records what reached the server.
    relay = Relay(live_without_worker.url, method="NONE", prefix="/", mode="503_after")
    try:
        yield relay
    finally:
        relay.close()


@pytest.fixture
def clients(relay: Relay) -> Iterator[tuple[Airlock, RunSession]]:
    agent = make_agent_with_token("id-bot")
    run = make_active_run(agent.agent)
    with Airlock(relay.url, agent.token) as airlock:
        yield airlock, airlock.join_run(run.token)


def id_methods(airlock: Airlock, session: RunSession) -> dict[str, Callable[[str], Any]]:
    return {
        "Airlock.get_run": airlock.get_run,
        "Airlock.get_action": airlock.get_action,
        "Airlock.wait_for_action": lambda i: airlock.wait_for_action(i, timeout=1),
        "Airlock.wait_for_supersede": lambda i: airlock.wait_for_supersede(i, timeout=1),
        "Airlock.list_actions": airlock.list_actions,
        "Airlock.get_plan": airlock.get_plan,
        "Airlock.wait_for_plan": lambda i: airlock.wait_for_plan(i, timeout=1),
        "RunSession.wait": lambda i: session.wait(i, timeout=1),
        "RunSession.wait_for_supersede": lambda i: session.wait_for_supersede(i, timeout=1),
        "RunSession.undo": session.undo,
        "RunSession.wait_for_plan": lambda i: session.wait_for_plan(i, timeout=1),
    }


def session_methods(session: RunSession) -> dict[str, Callable[[], Any]]:
    """The methods that put the session's own run id in the path."""
    return {
        "refresh": session.refresh,
        "heartbeat": session.heartbeat,
        "finish": session.finish,
        "actions": session.actions,
        "wait_for_approval": lambda: session.wait_for_approval(1),
        "propose_plan": lambda: session.propose_plan([], reason="r"),
    }


def resource_methods(airlock: Airlock, session: RunSession) -> dict[str, Callable[[str], Any]]:
    def base(identifier: str) -> Resource:
        kind, _, name = identifier.partition("/")
        return Resource(kind, name, 1, '"1"', {}, "platform", {})

    return {
        "Airlock.read": airlock.read,
        "RunSession.read": session.read,
        "RunSession.put": lambda r: session.put(base(r), {"a": 1}),
        "RunSession.patch": lambda r: session.patch(base(r), {"a": 1}),
        "RunSession.delete": lambda r: session.delete(base(r)),
        "RunSession.create": lambda r: session.create(r, {"a": 1}),
    }


def test_every_method_that_takes_an_id_refuses_one_that_is_not_a_uuid_and_sends_nothing(
    relay: Relay, clients: tuple[Airlock, RunSession]
) -> None:
    airlock, session = clients
    sent_before = len(relay.seen)
    for name, method in id_methods(airlock, session).items():
        for bad in BAD_IDS:
            with pytest.raises(InvalidIdentifier, match="must be a UUID"):
                method(bad)
                pytest.fail(f"{name}({bad!r}) was not refused")
    foreign = RunSession(airlock, Run.from_json({**session.run.raw, "id": "../../agents"}), "rt_x")
    for name, call in session_methods(foreign).items():
        with pytest.raises(InvalidIdentifier, match="run id must be a UUID"):
            call()
            pytest.fail(f"RunSession.{name} was not refused")
    for name, write in resource_methods(airlock, session).items():
        for bad in BAD_RESOURCES:
            with pytest.raises(InvalidIdentifier):
                write(bad)
                pytest.fail(f"{name}({bad!r}) was not refused")
    assert relay.seen[sent_before:] == []  # nothing reached the server


def test_an_id_in_another_spelling_is_sent_in_its_canonical_form(
    relay: Relay, clients: tuple[Airlock, RunSession]
) -> None:
    airlock, session = clients
    action_id = uuid.uuid4()
    with pytest.raises(NotFound):
        airlock.get_action(str(action_id).upper())
    with pytest.raises(NotFound):
        airlock.get_action("{" + action_id.hex + "}")
    paths = [path for _, path, _ in relay.seen[-2:]]
    assert paths == [f"/api/v1/actions/{action_id}"] * 2
    run = airlock.get_run(session.id.upper())
    assert run.id == session.id and relay.seen[-1][1] == f"/api/v1/runs/{session.id}"


def test_a_name_with_reserved_characters_is_one_quoted_segment(
    relay: Relay, clients: tuple[Airlock, RunSession]
) -> None:
    airlock, _ = clients
    for name, sent in [
        ("x?y", "x%3Fy"),
        ("a/../../../agents", "a%2F..%2F..%2F..%2Fagents"),
        ("a#b", "a%23b"),
        ("100%", "100%25"),
    ]:
        with pytest.raises(ProblemError) as refused:
            airlock.read(f"notification-policy/{name}")
        assert refused.value.status in (404, 422)  # the resource endpoint's own answer
        assert relay.seen[-1][1] == f"/api/v1/resources/notification-policy/{sent}"


def test_the_async_client_refuses_the_same_ids(relay: Relay, clients: Any) -> None:
    _, session = clients
    sent_before = len(relay.seen)

    async def main() -> None:
        async with AsyncAirlock(relay.url, session.token) as airlock:
            for bad in BAD_IDS:
                with pytest.raises(InvalidIdentifier):
                    await airlock.get_action(bad)
            with pytest.raises(InvalidIdentifier):
                await airlock.read("notification-policy/..")

    asyncio.run(main())
    assert relay.seen[sent_before:] == []
