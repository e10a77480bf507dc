"""A kind whose documents are files in a real git repository, governed through the executor
and the undo path (issue 39): the version is the file's blob id; a change to the same file by
someone else is a conflict, a commit elsewhere is not; an answer lost after the ref moved is
settled by reading (one commit, never two); undo commits the prior content conditionally."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from approvals.models import Action
from approvals.services.execution import action_execute
from approvals.services.undo import action_undo_request, undo_execute
from audit.services import Actor
from engine.targets.base import Outcome, WriteResult
from engine.targets.git import GitTarget
from ownership.targets import adapter_for_kind, read_through
from tests.fixtures.targets import airlock_commits, bare_repository, file_at_main, someone_commits

pytestmark = pytest.mark.django_db


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    bare = tmp_path / "config.git"
    return bare_repository(bare)


@pytest.fixture
def git_kind(engine_world: Any, engine_redis: Any, repo: Path) -> Any:
    kind = engine_world.kind("tenant-config", update="recompute_field", create="add_unique")
    kind.target = "git"
    kind.target_settings = {"repository": str(repo), "branch": "main", "path_prefix": "tenants/"}
    kind.save()
    seeded = adapter_for_kind(kind).create(
        "acme.json", {"limit": 1}, fence=1, idempotency_key="seed-acme-0001"
    )
    assert seeded.outcome is Outcome.APPLIED
    return kind


def _acme(repo: Path) -> Any:
    return file_at_main(repo, "tenants/acme.json")


def _wait_until_due(action: Action) -> None:
    action.refresh_from_db()
    if action.not_before:
        delay = (action.not_before - timezone.now()).total_seconds()
        if delay > 0:
            time.sleep(delay + 0.01)


def test_a_change_to_the_same_file_is_a_conflict_a_commit_elsewhere_is_not_and_undo_restores(
    engine_world: Any, git_kind: Any, repo: Path, tmp_path: Path
) -> None:
    seen = read_through(git_kind, "acme.json")  # what the agent read: the blob id
    assert seen is not None and seen.document == {"limit": 1}
    blob = seen.token
    someone_commits(repo, tmp_path, "tenants/acme.json", {"limit": 5})
    stale = engine_world.propose(git_kind, "acme.json", payload={"limit": 2}, observed_version=blob)
    assert action_execute(action_id=stale.pk) == "conflict"
    assert _acme(repo) == {"limit": 5}  # the other person's change stands

    fresh = read_through(git_kind, "acme.json")
    assert fresh is not None and fresh.token != blob
    action = engine_world.propose(
        git_kind, "acme.json", payload={"limit": 3}, observed_version=fresh.token
    )
    someone_commits(repo, tmp_path, "tenants/other.json", {"x": 1})  # elsewhere: no conflict
    assert action_execute(action_id=action.pk) == "applied"
    assert _acme(repo) == {"limit": 3} and airlock_commits(repo, action.pk) == 1
    assert file_at_main(repo, "tenants/other.json") == {"x": 1}

    undo = action_undo_request(action_id=action.pk, actor=Actor.run(engine_world.run))
    assert undo_execute(undo_operation_id=undo.pk) == "undone"
    assert _acme(repo) == {"limit": 5}
    action.refresh_from_db()
    assert action.status == "undone"


def test_an_answer_lost_after_the_branch_moved_is_settled_by_reading_one_commit(
    engine_world: Any, git_kind: Any, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = read_through(git_kind, "acme.json")
    assert seen is not None
    action = engine_world.propose(
        git_kind, "acme.json", payload={"limit": 7}, observed_version=seen.token
    )
    real_write = GitTarget.write
    lost: list[bool] = []
    calls: list[int] = []

    def write_then_lose_the_answer(self: Any, *args: Any, **kwargs: Any) -> WriteResult:
        calls.append(kwargs["fence"])
        result = real_write(self, *args, **kwargs)
        if not lost:  # the commit landed and the ref moved; the worker never heard
            lost.append(True)
            assert result.outcome is Outcome.APPLIED
            return WriteResult(Outcome.UNKNOWN, detail="killed after update-ref")
        return result

    monkeypatch.setattr(GitTarget, "write", write_then_lose_the_answer)
    assert action_execute(action_id=action.pk) == "unknown"
    _wait_until_due(action)
    assert action_execute(action_id=action.pk) == "applied"  # settled by reading, not resent
    assert _acme(repo) == {"limit": 7}
    assert airlock_commits(repo, action.pk) == 1
    assert len(calls) == 1  # the second attempt read the file and sent nothing
