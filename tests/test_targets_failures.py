"""What goes wrong at an external target (issue 39), per adapter — PostgreSQL rows, a git
repository, an HTTP/ETag service (WsgiDAV, a WebDAV server no one here wrote) — through the
executor and a real worker process:

- a target that is down: every attempt backs off, the action ends `failed` when the attempts
  run out — never a false `applied`;
- a worker SIGKILLed after the target applied the write but before Airlock recorded it: the
  reconciler takes the dead worker's operation back, another worker settles it by reading the
  target (our document under a new version → applied), nothing is sent a second time, and
  the effect is recorded exactly once.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action, Operation
from approvals.services.execution import action_execute
from approvals.services.reconcile import reconcile
from approvals.services.runs import run_finish
from approvals.services.undo import action_undo_request
from audit.models import AuditEvent
from audit.services import Actor
from engine.core.fence import next_fence
from engine.core.operations import open_operation
from engine.targets.base import Outcome
from ownership.models import Conflict, ResourceKind
from ownership.targets import adapter_for_kind, read_through
from tests.fixtures.dav import ENV as DAV_ENV
from tests.fixtures.dav import WSGIDAV, Dav, running, wsgidav_server
from tests.fixtures.engine import WORKER_LOCK_TTL_MS, wait_for
from tests.fixtures.targets import (
    ROWS_SETTINGS,
    airlock_commits,
    bare_repository,
    file_at_main,
    row,
    rows_database,
    someone_commits,
    someone_updates_row,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ROWS_ENV = "AIRLOCK_TEST_FAILURE_ROWS_DB"
CRASH = "external_after_target_applied"
# Attempts and backoff short enough for a test, long enough to see the backoff.
FAST_RETRIES = {"AIRLOCK_MAX_ATTEMPTS": "3", "AIRLOCK_BACKOFF_BASE_SECONDS": "0.2"}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again on return: nothing listens there


def _kind(slug: str, target: str, settings: dict[str, Any], target_url: str = "") -> ResourceKind:
    kind, _ = ResourceKind.objects.update_or_create(
        slug=slug,
        defaults={
            "class_create_id": "add_unique",
            "class_update_id": "recompute_field",
            "class_delete_id": "recompute_field",
            "owner_group": "owners",
            "target": target,
            "target_url": target_url,
            "target_settings": settings,
        },
    )
    return kind


def _status(action: Action) -> str:
    return str(Action.objects.values_list("status", flat=True).get(pk=action.pk))


@dataclass
class Governed:
    """One external kind with one document, `acme`, the agent has read (its mirror holds it)."""

    kind: ResourceKind
    name: str
    worker_env: dict[str, str]
    target_document: Callable[[], Any]  # what the target holds now
    # How many times the target took this action (a row: all UPDATEs of it, any action).
    target_effects: Callable[[Action], int]
    someone_writes: Callable[[Any], None] = lambda _document: None  # outside Airlock


@pytest.fixture
def postgres_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[Governed]:
    with rows_database("failures", {"acme": {"seats": 5}}) as url:
        monkeypatch.setenv(ROWS_ENV, url)
        kind = _kind("billing-account", "postgres", {**ROWS_SETTINGS, "credentials_env": ROWS_ENV})
        yield Governed(
            kind,
            "acme",
            {ROWS_ENV: url},
            lambda: row(url, "acme")[0],
            # The adapter advances the version once per UPDATE it makes: 1 + its effects.
            lambda _action: row(url, "acme")[1] - 1,
            lambda document: someone_updates_row(url, "acme", document),
        )


@pytest.fixture
def git_file(tmp_path: Path) -> Governed:
    repo = bare_repository(tmp_path / "config.git")
    settings = {"repository": str(repo), "branch": "main", "path_prefix": "t/"}
    kind = _kind("tenant-config", "git", settings)
    seeded = adapter_for_kind(kind).create("acme.json", {"seats": 5}, fence=1, idempotency_key="s")
    assert seeded.outcome is Outcome.APPLIED
    return Governed(
        kind,
        "acme.json",
        {},
        lambda: file_at_main(repo, "t/acme.json"),
        lambda action: airlock_commits(repo, action.pk),
        lambda document: someone_commits(repo, tmp_path, "t/acme.json", document),
    )


@pytest.fixture
def dav_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Governed]:
    if not WSGIDAV.exists():
        pytest.skip("wsgidav is in the dev extra")
    for server in running(wsgidav_server(tmp_path), monkeypatch):
        yield _dav_governed(server)


def _dav_governed(server: Dav) -> Governed:
    settings = {
        "credentials_env": DAV_ENV,
        "auth_scheme": "Basic",
        "honours_idempotency_key": False,
        "honours_fencing_token": False,
    }
    kind = _kind("shared-file", "http", settings, target_url=server.url)
    seeded = adapter_for_kind(kind).create("acme", {"seats": 5}, fence=1, idempotency_key="s")
    assert seeded.outcome is Outcome.APPLIED
    time.sleep(1.05)  # WsgiDAV's tag has whole-second mtimes: let our write move it
    path = server.root / "acme"

    def someone_writes(document: Any) -> None:
        time.sleep(1.05)  # a new mtime second: the tag moves even at the same size
        path.write_text(json.dumps(document))

    return Governed(
        kind,
        "acme",
        {DAV_ENV: os.environ[DAV_ENV]},
        lambda: json.loads(path.read_text()),
        lambda _action: -1,  # WebDAV keeps no count: the document and the trail tell
        someone_writes,
    )


TARGETS = ["postgres_rows", "git_file", "dav_file"]


def _propose(engine_world: Any, governed: Governed) -> Action:
    mirror = read_through(governed.kind, governed.name)  # what the agent read
    assert mirror is not None
    return engine_world.propose(
        governed.kind,
        governed.name,
        payload={"seats": 9},
        payload_format="merge_patch",
        observed_version=mirror.token,
    )


@pytest.mark.parametrize("fixture", TARGETS)
def test_a_worker_killed_after_the_target_applied_is_settled_by_reading_exactly_once(
    engine_world: Any, rq_worker: Any, settings: Any, request: pytest.FixtureRequest, fixture: str
) -> None:
    governed: Governed = request.getfixturevalue(fixture)
    # The reconciler runs in this process: it judges the workers' leases by their TTL.
    settings.AIRLOCK_LOCK_TTL_MS = WORKER_LOCK_TTL_MS
    doomed = rq_worker(AIRLOCK_TEST_CRASH_AT=CRASH, **governed.worker_env)
    action = _propose(engine_world, governed)
    wait_for(lambda: not doomed.alive(), timeout=30, interval=0.01)
    assert doomed.process.returncode == -9, doomed.output()
    # The target took it; Airlock recorded nothing yet.
    assert governed.target_document() == {"seats": 9}
    assert _status(action) == "executing"
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).exists()

    survivor = rq_worker(**governed.worker_env)

    def settled() -> bool:
        reconcile()  # takes the dead worker's operation back, queues the action again
        return _status(action) in ("applied", "conflict", "failed")

    wait_for(settled, timeout=60, interval=0.2)
    assert _status(action) == "applied", survivor.output()
    assert governed.target_document() == {"seats": 9}
    if fixture != "dav_file":
        assert governed.target_effects(action) == 1  # one UPDATE / one commit
    done = Operation.objects.get(action=action, undo_of__isnull=True, status="done")
    assert done.outcome["settled_by_reading"] is True  # read, not sent again
    abandoned = Operation.objects.get(action=action, undo_of__isnull=True, status="failed")
    assert abandoned.outcome["abandoned"] is True
    applied = AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk)
    assert applied.count() == 1 and applied.get().details["settled_by_reading"] is True
    assert not Conflict.objects.filter(action=action).exists()


@pytest.fixture
def postgres_down(monkeypatch: pytest.MonkeyPatch) -> Governed:
    url = f"postgres://postgres@127.0.0.1:{_closed_port()}/nowhere"
    monkeypatch.setenv(ROWS_ENV, url)
    kind = _kind(
        "billing-account",
        "postgres",
        {**ROWS_SETTINGS, "credentials_env": ROWS_ENV, "connect_timeout": 1},
    )
    return Governed(kind, "acme", {ROWS_ENV: url}, lambda: None, lambda _action: 0)


@pytest.fixture
def git_down(tmp_path: Path) -> Governed:
    settings = {
        "repository": f"http://127.0.0.1:{_closed_port()}/config.git",
        "mirror": str(tmp_path / "mirror.git"),
        "branch": "main",
        "path_prefix": "t/",
    }
    kind = _kind("tenant-config", "git", settings)
    return Governed(kind, "acme.json", {}, lambda: None, lambda _action: 0)


@pytest.fixture
def dav_down(monkeypatch: pytest.MonkeyPatch) -> Governed:
    monkeypatch.setenv(DAV_ENV, "alice:nothing-listens")
    settings = {"credentials_env": DAV_ENV, "auth_scheme": "Basic"}
    settings.update(honours_idempotency_key=False, honours_fencing_token=False)
    url = f"http://127.0.0.1:{_closed_port()}"
    kind = _kind("shared-file", "http", settings, target_url=url)
    return Governed(kind, "acme", {DAV_ENV: os.environ[DAV_ENV]}, lambda: None, lambda _a: 0)


@pytest.mark.parametrize("fixture", ["postgres_down", "git_down", "dav_down"])
def test_a_target_that_is_down_backs_off_then_fails_never_a_false_applied(
    engine_world: Any, rq_worker: Any, request: pytest.FixtureRequest, fixture: str
) -> None:
    governed: Governed = request.getfixturevalue(fixture)
    # The agent read version "1" when the target was up (a mirror row at that token).
    engine_world.resource(governed.kind, governed.name, {"seats": 5}, version=1)
    worker = rq_worker(**FAST_RETRIES, **governed.worker_env)
    action = engine_world.propose(
        governed.kind, governed.name, payload={"seats": 9}, observed_version="1"
    )
    wait_for(lambda: _status(action) in ("applied", "failed", "conflict"), timeout=60)
    assert _status(action) == "failed", worker.output()
    action.refresh_from_db()
    assert action.error["code"] == "attempts_exhausted"
    assert str(action.error["reason"]).startswith("target_unreachable")
    attempts = list(Operation.objects.filter(action=action).order_by("started_at"))
    assert len(attempts) == 3
    for attempt in attempts:
        assert attempt.status == "failed"
        assert str(attempt.outcome["refused"]).startswith("target_unreachable")
    # Backed off between attempts (full jitter: at least half the base, then doubling).
    gaps = [
        (later.started_at - earlier.started_at).total_seconds()
        for earlier, later in pairwise(attempts)
    ]
    assert all(gap >= 0.1 for gap in gaps), gaps
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action.pk).exists()
    assert Operation.objects.filter(action=action, status__in=("done", "unknown")).count() == 0


@pytest.mark.parametrize("fixture", TARGETS)
def test_two_runs_from_the_same_version_exactly_one_applies_the_other_is_routed(
    engine_world: Any, rq_worker: Any, request: pytest.FixtureRequest, fixture: str
) -> None:
    """The design's collision on each target: two runs read the same version and each
    proposes its change; the worker executes both. One applies; the other meets the target's
    newer version and becomes a conflict routed by its class (the agent's to redo); the
    first one's change is kept, nothing is lost."""
    governed: Governed = request.getfixturevalue(fixture)
    mirror = read_through(governed.kind, governed.name)
    assert mirror is not None
    first, second = (
        engine_world.propose(
            governed.kind,
            governed.name,
            run=run,
            payload={"seats": seats},
            payload_format="merge_patch",
            observed_version=mirror.token,
        )
        for run, seats in ((engine_world.run, 9), (engine_world.other_run, 11))
    )
    worker = rq_worker(**governed.worker_env)
    final = ("applied", "conflict", "failed")
    wait_for(lambda: _status(first) in final and _status(second) in final, timeout=60)
    statuses = {_status(first), _status(second)}
    assert statuses == {"applied", "conflict"}, worker.output()
    winner, loser = (first, second) if _status(first) == "applied" else (second, first)
    assert governed.target_document() == {"seats": 9 if winner is first else 11}
    if fixture == "postgres_rows":
        assert governed.target_effects(winner) == 1  # one UPDATE of the row in all
    elif fixture == "git_file":
        assert (governed.target_effects(winner), governed.target_effects(loser)) == (1, 0)
    conflict = Conflict.objects.get(action=loser, origin="write")
    assert conflict.resolver == "agent"  # recompute_field: the agent re-reads and redoes
    assert conflict.current_version != mirror.token  # the winner's version, not the base


@pytest.mark.parametrize("fixture", TARGETS)
def test_undo_after_someone_else_changed_the_target_is_a_conflict_never_an_overwrite(
    engine_world: Any, rq_worker: Any, request: pytest.FixtureRequest, fixture: str
) -> None:
    governed: Governed = request.getfixturevalue(fixture)
    worker = rq_worker(**governed.worker_env)
    action = _propose(engine_world, governed)
    wait_for(lambda: _status(action) in ("applied", "conflict", "failed"), timeout=60)
    assert _status(action) == "applied", worker.output()
    governed.someone_writes({"seats": 40})

    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
    wait_for(lambda: Operation.objects.get(pk=undo.pk).status != "pending", timeout=60)
    undo.refresh_from_db()
    assert undo.status == "failed" and undo.outcome["reason"] == "resource_moved", undo.outcome
    assert governed.target_document() == {"seats": 40}  # someone's change stands
    assert _status(action) == "applied"
    conflict = Conflict.objects.get(action=action, origin="undo")
    assert conflict.status == "open"
    assert not AuditEvent.objects.filter(event_type="write.undone", action_id=action.pk).exists()


@pytest.mark.parametrize("fixture", TARGETS)
@pytest.mark.parametrize("reached", [True, False], ids=["reached", "never_sent"])
def test_a_write_whose_worker_died_is_settled_by_reading_even_after_its_run_ended(
    engine_world: Any,
    engine_redis: Any,
    request: pytest.FixtureRequest,
    fixture: str,
    reached: bool,
) -> None:
    """A worker died holding the write (the reconciler abandons its operation) and the run
    finished before the next attempt. If the write reached the target it is recorded
    `applied` (read, not sent); if it never did, it is not sent now: `cancelled`."""
    governed: Governed = request.getfixturevalue(fixture)
    action = _propose(engine_world, governed)
    fence = next_fence()
    if reached:  # the dead worker's write landed; its answer died with it
        landed = adapter_for_kind(governed.kind).write(
            governed.name,
            {"seats": 9},
            expected_version=str(action.observed_version),
            fence=fence,
            idempotency_key="the-dead-worker",
        )
        assert landed.outcome is Outcome.APPLIED
    open_operation(action_id=action.pk, fence=fence, worker="dead", lease_seconds=1)
    assert reconcile(now=timezone.now() + timedelta(seconds=30))["abandoned"] == 1
    run_finish(run=engine_world.run, actor=Actor.run(engine_world.run))
    assert _status(action) == "queued"  # may have reached the target: not cancelled yet
    Action.objects.filter(pk=action.pk).update(not_before=None)

    outcome = action_execute(action_id=action.pk)
    if reached:
        assert (outcome, _status(action)) == ("applied", "applied")
        assert governed.target_document() == {"seats": 9}
        done = Operation.objects.get(action=action, status="done")
        assert done.outcome["settled_by_reading"] is True
    else:
        assert (outcome, _status(action)) == ("run_not_active", "cancelled")
        assert governed.target_document() == {"seats": 5}  # nothing sent after the run ended
        closed = Operation.objects.get(action=action, outcome__was_abandoned=True)
        assert closed.outcome["settled"] == "not_applied"
    if fixture == "git_file":
        assert governed.target_effects(action) == 0  # the dead worker's commit named no action
    elif fixture == "postgres_rows":
        assert governed.target_effects(action) == int(reached)


@pytest.mark.parametrize("fixture", TARGETS)
def test_an_undo_whose_worker_is_killed_after_the_target_applied_it_is_recorded_once(
    engine_world: Any, rq_worker: Any, settings: Any, request: pytest.FixtureRequest, fixture: str
) -> None:
    """The undo's write reached the target and the worker died before recording it: the
    undo is delivered again, reads the target (the prior document under a new version) and
    is recorded `undone` — not resent, not a false conflict."""
    governed: Governed = request.getfixturevalue(fixture)
    settings.AIRLOCK_LOCK_TTL_MS = WORKER_LOCK_TTL_MS  # the in-process reconciler's view
    first = rq_worker(**governed.worker_env)
    action = _propose(engine_world, governed)
    wait_for(lambda: _status(action) in ("applied", "conflict", "failed"), timeout=60)
    assert _status(action) == "applied", first.output()
    first.stop()
    if fixture == "dav_file":
        time.sleep(1.05)  # WsgiDAV's whole-second tags: the undo's write must move it

    doomed = rq_worker(
        AIRLOCK_TEST_CRASH_AT="external_undo_after_target_applied", **governed.worker_env
    )
    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
    wait_for(lambda: not doomed.alive(), timeout=30, interval=0.01)
    assert doomed.process.returncode == -9, doomed.output()
    assert governed.target_document() == {"seats": 5}  # undone at the target, not on record
    assert Operation.objects.get(pk=undo.pk).status == "pending"

    survivor = rq_worker(**governed.worker_env)

    def settled() -> bool:
        reconcile()  # delivers the undo again once the dead worker's lease is over
        return Operation.objects.get(pk=undo.pk).status != "pending"

    wait_for(settled, timeout=60, interval=0.2)
    undo.refresh_from_db()
    assert undo.status == "done", (undo.outcome, survivor.output())
    assert _status(action) == "undone"
    assert governed.target_document() == {"seats": 5}
    assert AuditEvent.objects.filter(event_type="write.undone", action_id=action.pk).count() == 1
    assert not Conflict.objects.filter(action=action).exists()
    if fixture == "git_file":
        assert governed.target_effects(action) == 2  # the write and one undo commit
    elif fixture == "postgres_rows":
        assert governed.target_effects(action) == 2  # one UPDATE each
