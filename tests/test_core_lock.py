"""The fenced lock: token-checked release and renew, fences from PostgreSQL that
survive Redis losing everything, and a paused holder refused by the fence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from approvals.models import Operation, OperationStatus
from audit.models import AuditEvent
from audit.verify import verify_chain
from engine.core.errors import LockBusy, LockLost
from engine.core.fence import (
    current_fence,
    ensure_fence_floor,
    ensure_fence_floor_once,
    fence_floor,
    next_fence,
)
from engine.core.lock import FencedLock, FencedLockGroup, lock_key
from ownership.models import Resource
from tests.conftest import PrivateRedis
from tests.fixtures.core import execute, make_action, make_resource, make_run, spawn_worker

# Fences come from PostgreSQL: every test here reaches the database.
pytestmark = pytest.mark.django_db


def unique_key() -> str:
    return f"notification-policy/lock-{uuid.uuid4().hex[:12]}"


LockOnKey = Callable[[int], FencedLock]


@pytest.fixture
def lock_on_key(redis_client: redis.Redis) -> LockOnKey:
    """A new FencedLock with the given TTL (ms), on one key no other test uses."""
    key = unique_key()
    return lambda ttl_ms: FencedLock(redis_client, key=key, ttl_ms=ttl_ms)


def test_fences_rise_strictly_and_come_from_postgresql() -> None:
    fences = [next_fence() for _ in range(20)]
    assert fences == sorted(set(fences))
    assert current_fence() == fences[-1]


def test_a_lock_group_takes_the_free_locks_under_one_fence_and_gives_them_all_back(
    redis_client: redis.Redis,
) -> None:
    lead, free, busy = (FencedLock(redis_client, key=unique_key(), ttl_ms=5_000) for _ in "abc")
    other = FencedLock(redis_client, key=busy.key, ttl_ms=5_000)
    earlier = other.acquire()  # the busy resource's holder, with an earlier fence
    lead.take()
    group = FencedLockGroup(redis_client, [lead])
    group.join([free, busy])
    assert group.locks == [lead, free]  # the busy one is left out, not waited for
    fence = group.fence()
    assert fence > earlier and lead.fence == free.fence == fence
    assert lead.held() and free.held() and other.held()
    group.release()
    assert not lead.held() and not free.held() and other.held()


def test_a_lock_group_drops_a_lock_taken_while_its_fence_was_drawn(
    redis_client: redis.Redis,
) -> None:
    lead, lost = (FencedLock(redis_client, key=unique_key(), ttl_ms=5_000) for _ in "ab")
    lead.take()
    group = FencedLockGroup(redis_client, [lead])
    group.join([lost])
    redis_client.set(lock_key(lost.key), "a-successor")  # expired and taken meanwhile
    group.fence()
    assert group.locks == [lead]
    assert redis_client.get(lock_key(lost.key)) == b"a-successor"  # not ours to release
    # The lead itself lost: the whole group is busy and gives everything back.
    second, other = (FencedLock(redis_client, key=unique_key(), ttl_ms=5_000) for _ in "ab")
    second.take()
    group = FencedLockGroup(redis_client, [second])
    group.join([other])
    redis_client.set(lock_key(second.key), "a-successor")
    with pytest.raises(LockBusy):
        group.fence()
    assert not other.held()
    group.release()


def test_a_second_holder_is_busy_and_a_wrong_token_can_neither_renew_nor_release(
    redis_client: redis.Redis, lock_on_key: LockOnKey
) -> None:
    first = lock_on_key(5_000)
    fence = first.acquire()
    assert first.fence == fence and first.held()
    assert redis_client.get(lock_key(first.key)) == first.token.encode()

    second = lock_on_key(5_000)
    with pytest.raises(LockBusy):
        second.acquire(wait_seconds=0.05)
    with pytest.raises(LockLost):
        second.renew()
    assert second.release() is False
    assert first.held()  # untouched by the impostor

    first.renew()
    assert first.release() is True
    assert not first.held()
    assert first.release() is False

    # Now free: the second takes it with a larger fence.
    assert second.acquire() > fence
    second.release()


def test_an_expired_lock_cannot_be_renewed_and_its_successor_has_a_larger_fence(
    lock_on_key: LockOnKey,
) -> None:
    first = lock_on_key(100)
    old_fence = first.acquire()
    time.sleep(0.2)
    successor = lock_on_key(5_000)
    new_fence = successor.acquire()
    assert new_fence > old_fence
    with pytest.raises(LockLost):
        first.renew()
    assert first.lost
    with pytest.raises(LockLost):
        first.check()
    assert first.release() is False
    assert successor.held()
    successor.release()


def test_waiting_acquire_gets_the_lock_when_the_holder_releases(lock_on_key: LockOnKey) -> None:
    with lock_on_key(300) as holder:
        assert holder.held()
        waiter = lock_on_key(1_000)
        started = time.monotonic()
        fence = waiter.acquire(wait_seconds=3)  # the holder's TTL runs out
        assert time.monotonic() - started < 2
        assert fence > (holder.fence or 0)
    assert waiter.held()  # the holder's exit did not release the waiter's lock
    waiter.release()


def test_the_heartbeat_keeps_the_lock_past_its_ttl(redis_client: redis.Redis) -> None:
    # TTL 1 s renewed every 250 ms: a scheduling stall of up to ~750 ms on a loaded
    # machine still renews in time. The sleep is the subject (time passing past the
    # TTL), not synchronisation: without the heartbeat the key expires after 1 s.
    lock = FencedLock(redis_client, key=unique_key(), ttl_ms=1_000)
    lock.acquire()
    lock.start_heartbeat(interval_ms=250)
    time.sleep(1.6)
    assert lock.held() and not lock.lost
    lock.check()
    assert lock.release() is True


def test_flushall_and_a_restart_of_redis_never_send_the_fence_backwards(
    private_redis: PrivateRedis,
) -> None:
    resource = make_resource("notification-policy/flush", {"v": 0}, version=1)
    run = make_run()
    key = "notification-policy/flush"

    def write_once(value: int, observed: int) -> Any:
        client = private_redis.client()
        with FencedLock(client, key=key, ttl_ms=5_000) as lock:
            assert lock.fence is not None
            action = make_action(
                run=run, identifier=key, payload={"v": value}, observed_version=observed
            )
            outcome = execute(action, fence=lock.fence)
        client.close()
        return outcome

    first = write_once(1, 1)
    assert first.applied
    accepted_max = Resource.objects.get(pk=resource.pk).last_fence

    private_redis.client().flushall()
    second = write_once(2, 2)
    assert second.applied and second.fence > accepted_max
    accepted_max = Resource.objects.get(pk=resource.pk).last_fence

    private_redis.restart()  # no persistence: the new server starts empty
    assert private_redis.client().dbsize() == 0
    third = write_once(3, 3)
    assert third.applied and third.fence > accepted_max
    assert first.fence < second.fence < third.fence
    assert next_fence() > fence_floor()

    # A holder from before the flush still carries its old fence: refused.
    stale = make_action(run=run, identifier=key, payload={"v": -1}, observed_version=4)
    refused = execute(stale, fence=first.fence)
    assert not refused.applied and refused.reason == "stale_fence"
    assert Resource.objects.get(pk=resource.pk).document == {"v": 3}


def test_ensure_fence_floor_lifts_a_sequence_left_behind_by_a_restore() -> None:
    ensure_fence_floor_once()  # this process has taken its first fence already
    resource = make_resource("notification-policy/restored", {}, version=1)
    far_ahead = current_fence() + 10_000
    Resource.objects.filter(pk=resource.pk).update(last_fence=far_ahead)
    assert next_fence() < far_ahead  # what a restored, older sequence would do
    assert ensure_fence_floor() == far_ahead
    assert next_fence() > far_ahead
    before = current_fence()
    ensure_fence_floor()  # never moves it down
    assert current_fence() == before


# -- the paused holder: real processes, SIGSTOP past the TTL -------------------------


def _spawn(action_id: Any, key: str, *extra: str) -> subprocess.Popen[str]:
    return spawn_worker(
        "write", "--action", str(action_id), "--key", key, "--ttl-ms", "1000", *extra
    )


def _read_event(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        assert process.stderr is not None
        raise AssertionError(f"worker exited: {process.wait()} {process.stderr.read()[-2000:]}")
    return dict(json.loads(line))


def _wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _paused_holder_scenario(redis_client: redis.Redis, *, renew: bool) -> dict[str, Any]:
    name = f"paused-{uuid.uuid4().hex[:8]}"
    key = f"notification-policy/{name}"
    resource = make_resource(key, {"owner": "nobody"}, version=5)
    run_a, run_b = make_run("paused-a"), make_run("paused-b")
    action_a = make_action(run=run_a, identifier=key, payload={"owner": "a"}, observed_version=5)
    action_b = make_action(run=run_b, identifier=key, payload={"owner": "b"}, observed_version=5)

    holder = _spawn(action_a.pk, key, "--pause", *([] if renew else ["--no-renew"]))
    try:
        locked = _read_event(holder)
        assert locked["event"] == "locked"
        # The heartbeat keeps the 1 s lock alive past its TTL while the holder runs...
        time.sleep(1.3)
        assert redis_client.get(lock_key(key)) is not None
        # ...until the process is stopped: no heartbeat, the TTL runs out.
        os.kill(holder.pid, signal.SIGSTOP)
        assert _wait_until(lambda: redis_client.get(lock_key(key)) is None, timeout=5)

        successor = _spawn(action_b.pk, key)
        successor_locked = _read_event(successor)
        assert successor_locked["fence"] > locked["fence"]
        written = _read_event(successor)
        assert written == {
            "event": "outcome",
            "applied": True,
            "reason": None,
            "fence": successor_locked["fence"],
            "result_version": 6,
        }
        assert successor.wait(timeout=30) == 0

        if not renew:
            # Make the version precondition pass, so only the fence can stop it.
            type(action_a).objects.filter(pk=action_a.pk).update(observed_version=6)

        os.kill(holder.pid, signal.SIGCONT)
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        result = _read_event(holder)
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
            holder.wait()

    resource.refresh_from_db()
    assert resource.document == {"owner": "b"}
    assert resource.version == 6
    assert resource.last_fence == successor_locked["fence"]
    return {
        "result": result,
        "locked": locked,
        "action_a": action_a,
        "operation": locked["operation"],
    }


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_paused_holder_that_skips_renew_is_refused_by_the_fence(
    redis_client: redis.Redis,
) -> None:
    scenario = _paused_holder_scenario(redis_client, renew=False)
    result = scenario["result"]
    assert result["event"] == "outcome"
    assert result["applied"] is False
    assert result["reason"] == "stale_fence"
    operation = Operation.objects.get(pk=scenario["operation"])
    assert operation.status == OperationStatus.FAILED
    assert operation.outcome["reason"] == "stale_fence"
    refused = AuditEvent.objects.get(event_type="write.refused", action_id=scenario["action_a"].pk)
    assert refused.details["fence"] == scenario["locked"]["fence"]
    assert refused.details["current_fence"] > refused.details["fence"]
    assert verify_chain().ok


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_paused_holder_that_renews_stops_before_writing(redis_client: redis.Redis) -> None:
    scenario = _paused_holder_scenario(redis_client, renew=True)
    assert scenario["result"]["event"] == "lock_lost"
    # It never reached the barrier: its operation is still pending for the reconciler.
    assert Operation.objects.get(pk=scenario["operation"]).status == OperationStatus.PENDING
    assert not AuditEvent.objects.filter(action_id=scenario["action_a"].pk).exists()


def _increment_in_processes(
    *, lock: bool, processes: int = 4, count: int = 6
) -> list[dict[str, Any]]:
    key = f"notification-policy/counter-{uuid.uuid4().hex[:8]}"
    make_resource(key, {"n": 0}, version=1)
    run = make_run(f"counter-{uuid.uuid4().hex[:6]}")
    workers = [
        spawn_worker(
            "increment",
            *("--run", str(run.pk), "--key", key, "--count", str(count), "--label", f"p{index}"),
            *(["--lock"] if lock else []),
        )
        for index in range(processes)
    ]
    for worker in workers:
        assert _read_event(worker) == {"event": "ready"}
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = processes * count
    resource = Resource.objects.get(kind_id="notification-policy", name=key.split("/")[1])
    # Nothing lost, nothing applied twice: every increment landed exactly once.
    assert resource.document["n"] == total
    assert resource.version == 1 + total
    versions = list(resource.versions.order_by("version").values_list("version", flat=True))
    assert versions == list(range(1, total + 2))
    assert AuditEvent.objects.filter(event_type="write.applied", resource=key).count() == total
    refused = sum(r["refused"] for r in results)
    assert AuditEvent.objects.filter(event_type="write.refused", resource=key).count() == refused
    assert verify_chain().ok
    return results


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_four_processes_racing_read_modify_writes_lose_nothing_without_the_lock() -> None:
    results = _increment_in_processes(lock=False)
    # The collision was real: some attempts met a newer version and retried.
    assert sum(r["refused"] for r in results) > 0


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_four_processes_holding_the_lock_never_collide() -> None:
    results = _increment_in_processes(lock=True)
    assert sum(r["refused"] for r in results) == 0
