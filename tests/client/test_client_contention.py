"""airlock-client on a hot resource, against a live Airlock: a forced collision of two
clients that read the same version. The loser is told (by its 412, or by its read)
which approved write will replace that version, waits for it instead of proposing
again, then writes on the new version: nothing lost, nothing applied twice."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from airlock_client import Action, Airlock, Contention, Resource, RunSession, StaleVersion

from approvals.models import Action as ActionRow
from ownership.models import Resource as ResourceRow
from tests.client.conftest import POLICY, POLICY_WRITE_SET, Live
from tests.test_api_longpoll import wait_until_held

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Quick back-off: the test is about who waits for what, not about pacing.
QUICK = Contention(base=0.05, cap=0.2)


def add_channel(channel: str) -> Callable[[Resource], dict[str, Any] | None]:
    """The change each client wants: its channel added to what it read."""

    def change(current: Resource) -> dict[str, Any] | None:
        channels = list(current.document.get("channels", []))
        return None if channel in channels else {"channels": [*channels, channel]}

    return change


def in_background(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(value=work()), daemon=True)
    thread.start()
    return thread, result


def approved_and_queued(live: Live, run: RunSession, patch: dict[str, Any]) -> Action:
    """A per-call write of the policy as read now, approved: queued (no worker yet)."""
    action = run.patch(run.read(POLICY), patch, reason="winner")
    live.decide(action=action.id)
    return action


@contextlib.contextmanager
def two_clients_of_one_run(live: Live, token: str) -> Iterator[tuple[RunSession, RunSession]]:
    """A run over the policy (approved by a person) and a second client of it, as the
    bench's writers are: both read the same versions."""
    live.approve_next_run_of(token)
    with (
        Airlock(live.url, token) as airlock,
        airlock.start_run("two clients, one policy", POLICY_WRITE_SET) as first,
        Airlock(live.url, first.token) as second,
    ):
        yield first, second.join_run()


def test_the_loser_of_a_collision_waits_for_the_winner_then_writes_on_the_new_version(
    live_without_worker: Live, rq_worker: Any, agent_tokens: dict[str, str]
) -> None:
    live = live_without_worker
    with two_clients_of_one_run(live, agent_tokens["alerts-bot-a"]) as (winner, loser):
        seen_by_loser = loser.read(POLICY)
        assert seen_by_loser.etag == '"41"' and seen_by_loser.queued_action is None
        won = approved_and_queued(live, winner, {"channels": ["email", "winner"]})

        # Both read version 41; the winner's approved write is queued over it.
        with pytest.raises(StaleVersion) as refused:
            loser.patch(seen_by_loser, {"channels": ["email", "loser"]}, reason="loser")
        assert refused.value.expected_etag == refused.value.current_etag == '"41"'
        assert refused.value.queued_action == won.id
        assert loser.read(POLICY).queued_action == won.id  # a read says so too
        # Another agent may not read the winner's action: nothing to wait on.
        assert Airlock(live.url, agent_tokens["dns-bot"]).wait_for_supersede(won.id) is None

        waiter, waited = in_background(lambda: loser.wait_for_supersede(refused.value))
        wait_until_held(live.url, 1, waiter)  # held by the server, not spinning
        rq_worker()
        waiter.join(timeout=60)
        assert waited["value"].id == won.id and waited["value"].status == "applied"

        rewrite, rewritten = in_background(
            lambda: loser.update(POLICY, add_channel("loser"), reason="re-read", timeout=60)
        )
        live.decide(agent="alerts-bot-a")  # the loser's write, proposed on version 42
        rewrite.join(timeout=60)
        assert rewritten["value"].status == "applied"
        assert rewritten["value"].result_etag == '"43"'
    row = ResourceRow.objects.get(kind_id="notification-policy", name="prod-alerts")
    assert row.version == 43
    assert row.document["channels"] == ["email", "winner", "loser"]  # nothing lost
    statuses = sorted(ActionRow.objects.filter(name="prod-alerts").values_list("status", flat=True))
    assert statuses == ["applied", "applied"]  # nothing applied twice, no conflict


def test_update_waits_for_a_write_its_read_names_instead_of_proposing(
    live_without_worker: Live, rq_worker: Any, agent_tokens: dict[str, str]
) -> None:
    live = live_without_worker
    with two_clients_of_one_run(live, agent_tokens["alerts-bot-a"]) as (winner, loser):
        approved_and_queued(live, winner, {"channels": ["email", "winner"]})
        rewrite, rewritten = in_background(
            lambda: loser.update(POLICY, add_channel("loser"), timeout=60, contention=QUICK)
        )
        wait_until_held(live.url, 1, rewrite)  # waiting for the winner, not proposing
        assert ActionRow.objects.filter(name="prod-alerts").count() == 1
        rq_worker()
        live.decide(agent="alerts-bot-a")  # the loser's write, proposed on version 42
        rewrite.join(timeout=60)
        assert rewritten["value"].status == "applied"
    row = ResourceRow.objects.get(kind_id="notification-policy", name="prod-alerts")
    assert (row.version, row.document["channels"]) == (43, ["email", "winner", "loser"])
    # The loser never proposed on version 41: no refused write, no conflict.
    observed = ActionRow.objects.filter(name="prod-alerts").values_list("observed_version")
    assert sorted(version for (version,) in observed) == ["41", "42"]
