"""Plans across external targets (issue 39): a three-step plan over rows of a real PostgreSQL
table and a file in a real git repository, proposed through the API and run by a real worker.

- it succeeds: every step applied exactly once (one UPDATE per row, one commit for the file);
- step 3 fails for good: steps 2 and 1 are compensated, last first, through the external
  undo path (conditional writes of the documents from before) — the targets end as before;
- a compensation that meets a target someone changed since becomes a conflict for a person,
  never an overwrite, and the earlier step waits (strict reverse order).

The table lives in a scratch database (the test database's name + `_plans`), changed by "someone
else" through a plain psycopg connection; the repository is a bare one in `tmp_path`, changed
by someone else through a clone and a push."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from approvals.models import Action, CompensationStatus, Operation, Plan, PlanStep
from audit.models import AuditEvent
from engine.targets.base import Outcome
from ownership.models import Conflict, ResourceKind
from ownership.targets import adapter_for_kind
from tests.fixtures import plans as plan_fx
from tests.fixtures.api import make_active_run, make_agent_with_token, problem
from tests.fixtures.engine import wait_for
from tests.fixtures.targets import (
    ROWS_SETTINGS,
    airlock_commits,
    bare_repository,
    blob_at_main,
    file_at_main,
    row,
    rows_database,
    someone_commits,
    someone_updates_row,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ENV = "AIRLOCK_TEST_PLAN_ROWS_DB"
ROWS = "billing-account"
FILES = "tenant-config"
FINAL = ("applied", "compensated", "partially_compensated")


@pytest.fixture
def rows_db(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with rows_database("plans", {"acme": {"seats": 5}, "globex": {"seats": 3}}) as url:
        monkeypatch.setenv(ENV, url)
        yield url


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return bare_repository(tmp_path / "config.git")


@pytest.fixture
def kinds(db: Any, rows_db: str, repo: Path) -> dict[str, ResourceKind]:
    """Two external kinds (per-run classes, retryable by the agent: a plan runs at once and
    a stale step stops it), and the file the plan writes."""
    common = {
        "class_create_id": "add_unique",
        "class_update_id": "recompute_field",
        "class_delete_id": "recompute_field",
        "owner_group": "platform",
    }
    rows, _ = ResourceKind.objects.update_or_create(
        slug=ROWS,
        defaults={
            **common,
            "target": "postgres",
            "target_settings": {**ROWS_SETTINGS, "credentials_env": ENV, "lock_timeout": 0.5},
        },
    )
    files, _ = ResourceKind.objects.update_or_create(
        slug=FILES,
        defaults={
            **common,
            "target": "git",
            "target_settings": {"repository": str(repo), "branch": "main", "path_prefix": "t/"},
        },
    )
    seeded = adapter_for_kind(files).create(
        "acme.json", {"limit": 1}, fence=1, idempotency_key="seed-acme-0001"
    )
    assert seeded.outcome is Outcome.APPLIED
    return {"rows": rows, "files": files}


def _run() -> Any:
    agent = make_agent_with_token(f"plan-bot-{uuid.uuid4().hex[:6]}")
    ops = ["create", "update", "delete"]
    return make_active_run(
        agent.agent,
        [
            {"resource": f"{ROWS}/acme", "operations": ops},
            {"resource": f"{ROWS}/globex", "operations": ops},
            {"resource": f"{FILES}/acme.json", "operations": ops},
        ],
    )


def _row(rows_db: str, key: str) -> tuple[dict[str, Any], int]:
    return row(rows_db, key)


def _file(repo: Path) -> Any:
    return file_at_main(repo, "t/acme.json")


def _blob(repo: Path) -> str:
    return blob_at_main(repo, "t/acme.json")


def _steps(repo: Path) -> list[dict[str, Any]]:
    """postgres, git, postgres — the tags as the targets give them (the agent never read
    them through Airlock: the plan's proposal reads each external step's target)."""
    return [
        plan_fx.patch_step(f"{ROWS}/acme", '"1"', {"seats": 9}),
        plan_fx.put_step(f"{FILES}/acme.json", f'"{_blob(repo)}"', {"limit": 2}),
        plan_fx.patch_step(f"{ROWS}/globex", '"1"', {"seats": 4}),
    ]


def _step(plan_id: str, position: int) -> PlanStep:
    return PlanStep.objects.select_related("action").get(plan_id=plan_id, position=position)


def _events(event_type: str, action: Action | None) -> list[AuditEvent]:
    assert action is not None
    return list(AuditEvent.objects.filter(event_type=event_type, action_id=action.pk))


def test_a_plan_across_postgres_and_git_applies_every_step_exactly_once(
    api: Any, kinds: Any, rows_db: str, repo: Path, rq_worker: Any
) -> None:
    run = _run()
    blob = _blob(repo)
    plan_id = plan_fx.proposed_plan(api, run, _steps(repo))
    worker = rq_worker(**{ENV: os.environ[ENV]})
    wait_for(lambda: plan_fx.plan_status(plan_id) in FINAL, timeout=60)
    assert plan_fx.plan_status(plan_id) == "applied", worker.output()

    # One UPDATE per row (the version advanced once), one commit for the file.
    assert _row(rows_db, "acme") == ({"seats": 9}, 2)
    assert _row(rows_db, "globex") == ({"seats": 4}, 2)
    assert _file(repo) == {"limit": 2}
    for position in (1, 2, 3):
        action = _step(plan_id, position).action
        assert action is not None and action.status == "applied"
        assert len(_events("write.applied", action)) == 1
        assert Operation.objects.filter(action=action, status="done").count() == 1
    assert airlock_commits(repo, _step(plan_id, 2).action_id) == 1
    body = plan_fx.read_plan(api, run.token, plan_id)
    assert [s["status"] for s in body["steps"]] == ["applied"] * 3
    # What the approver saw: each step against the document the target held.
    assert all(s["observed_recorded"] for s in body["steps"])
    assert body["steps"][1]["diff"] and body["steps"][1]["observed_etag"] == f'"{blob}"'


def test_a_plan_that_fails_at_step_3_compensates_steps_2_then_1_and_the_targets_end_as_before(
    api: Any, kinds: Any, rows_db: str, repo: Path, rq_worker: Any
) -> None:
    run = _run()
    blob_before = _blob(repo)
    plan_id = plan_fx.proposed_plan(api, run, _steps(repo))
    # Someone else changes step 3's row after the proposal, before the worker runs it: its
    # conditional UPDATE is refused at the target, and its class (the agent's to retry)
    # stops the plan.
    someone_updates_row(rows_db, "globex", {"seats": 30})
    worker = rq_worker(**{ENV: os.environ[ENV]})
    wait_for(lambda: plan_fx.plan_status(plan_id) in FINAL, timeout=60)
    assert plan_fx.plan_status(plan_id) == "compensated", worker.output()

    # As before: the documents restored by conditional writes (the row's version moved on:
    # the write and its compensation), the file back at the very same blob; step 3's row
    # keeps the other writer's change.
    assert _row(rows_db, "acme") == ({"seats": 5}, 3)
    assert _file(repo) == {"limit": 1} and _blob(repo) == blob_before
    assert _row(rows_db, "globex") == ({"seats": 30}, 2)

    first, second, third = (_step(plan_id, n) for n in (1, 2, 3))
    assert third.status == "refused" and third.error["code"] == "stale_version"
    assert (first.compensation_status, second.compensation_status) == ("compensated",) * 2
    undone = [_events("write.undone", s.action) for s in (first, second)]
    assert [len(events) for events in undone] == [1, 1]
    assert undone[1][0].pk < undone[0][0].pk  # step 2 compensated before step 1
    for step in (first, second):
        assert len(_events("write.applied", step.action)) == 1
    assert airlock_commits(repo, second.action_id) == 2  # the write and its compensation
    plan = Plan.objects.get(pk=plan_id)
    assert plan.error is not None and plan.error["step"] == 3


def test_a_compensation_that_meets_a_changed_target_is_a_conflict_never_an_overwrite(
    api: Any, kinds: Any, rows_db: str, repo: Path, rq_worker: Any, tmp_path: Path
) -> None:
    """Step 3's row is held by another transaction (the target is busy: backoff) while
    someone changes the file step 2 wrote; then step 3 meets that transaction's change.
    Step 2's compensation finds the file changed: a conflict for a person, the file kept,
    and step 1 waits (strict reverse order) — the plan is partially compensated."""
    run = _run()
    plan_id = plan_fx.proposed_plan(api, run, _steps(repo))
    with psycopg.connect(rows_db) as holder:
        holder.execute("SELECT 1 FROM accounts WHERE account_id = 'globex' FOR UPDATE")
        worker = rq_worker(**{ENV: os.environ[ENV]})

        def step_3_tried() -> bool:
            action = _step(plan_id, 3).action
            return action is not None and action.attempts >= 1

        wait_for(step_3_tried, timeout=60)
        action_3 = _step(plan_id, 3).action
        assert action_3 is not None and action_3.status in ("queued", "executing")
        busy = Operation.objects.filter(action=action_3, outcome__refused__startswith="target_busy")
        assert busy.exists()  # a busy target: backed off, nothing recorded as applied
        someone_commits(repo, tmp_path, "t/acme.json", {"limit": 50})
        holder.execute(
            "UPDATE accounts SET settings = %s, version = version + 1 WHERE account_id = 'globex'",
            [json.dumps({"seats": 30})],
        )
        holder.commit()
    wait_for(lambda: plan_fx.plan_status(plan_id) in FINAL, timeout=60)
    assert plan_fx.plan_status(plan_id) == "partially_compensated", worker.output()

    assert _file(repo) == {"limit": 50}  # someone's change stands
    assert _row(rows_db, "acme") == ({"seats": 9}, 2)  # step 1 waits for step 2's conflict
    assert _row(rows_db, "globex") == ({"seats": 30}, 2)
    first, second = _step(plan_id, 1), _step(plan_id, 2)
    assert second.compensation_status == "conflict"
    assert first.compensation_status == CompensationStatus.NONE  # not started
    conflict = Conflict.objects.get(action_id=second.action_id, origin="undo")
    assert conflict.status == "open"
    assert conflict.current_version == _blob(repo)
    assert _events("write.undone", second.action) == []
    assert airlock_commits(repo, second.action_id) == 1  # the write only: nothing overwrote


def test_a_step_on_an_unreachable_target_is_a_502_naming_the_step_and_records_nothing(
    api: Any, kinds: Any, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run()
    monkeypatch.setenv(ENV, "postgres://postgres@127.0.0.1:1/nowhere")
    steps = _steps(repo)
    response = plan_fx.propose_plan(api, run, [steps[1], steps[0]])
    body = problem(response, 502, "target_unavailable")
    assert body["step"] == 2
    assert not Plan.objects.exists()
