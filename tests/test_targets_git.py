"""The git files adapter (engine/targets/git.py) against real repositories in tmp_path.

Someone else's commits are made the ordinary way: a clone, `git commit`, `git push`.
The race window (between building our commit and moving the branch) is forced by running
that other commit from inside the adapter's own commit step, so the CAS really loses.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.targets.base import (
    ABSENT,
    Applied,
    Conflict,
    NotApplied,
    Outcome,
    Snapshot,
    TargetConfigError,
    TargetError,
    settle_by_reading,
)
from engine.targets.git import GitSettings, GitTarget
from tests.fixtures.git_http import HAVE_GIT_HTTP, served_repository
from tests.fixtures.git_http import PASSWORD as GIT_PASSWORD
from tests.fixtures.git_http import SKIP_REASON as GIT_HTTP_SKIP
from tests.fixtures.git_http import USER as GIT_USER


def _run(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=Someone", "-c", "user.email=someone@example.com", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.fixture
def bare(tmp_path: Path) -> Path:
    repo = tmp_path / "config.git"
    _run("init", "--bare", "--initial-branch=main", str(repo))
    return repo


@pytest.fixture(params=["local", "remote"])
def target(request: pytest.FixtureRequest, bare: Path, tmp_path: Path) -> GitTarget:
    """The same repository as a local path, and as a remote (file://) through a mirror:
    every test of this fixture runs against both."""
    if request.param == "remote":
        return GitTarget(
            GitSettings.from_settings(
                {
                    "repository": f"file://{bare}",
                    "mirror": str(tmp_path / "mirror.git"),
                    "branch": "main",
                    "path_prefix": "tenants/",
                }
            )
        )
    return GitTarget(
        GitSettings.from_settings(
            {"repository": str(bare), "branch": "main", "path_prefix": "tenants/"}
        )
    )


def _key() -> str:
    return f"airlock-action-{uuid.uuid4()}"


def _seed(target: GitTarget, name: str, document: Any) -> str:
    created = target.create(name, document, fence=1, idempotency_key=_key())
    assert created.outcome is Outcome.APPLIED, created
    assert created.version is not None
    return created.version


def _someone_commits(bare: Path, tmp_path: Path, path: str, content: str) -> None:
    clone = tmp_path / f"clone-{uuid.uuid4().hex[:6]}"
    _run("clone", "--quiet", "--branch", "main", str(bare), str(clone))
    (clone / path).parent.mkdir(parents=True, exist_ok=True)
    (clone / path).write_text(content)
    _run("add", path, cwd=clone)
    _run("commit", "--quiet", "-m", f"someone edits {path}", cwd=clone)
    _run("push", "--quiet", "origin", "main", cwd=clone)


def _commits(bare: Path) -> list[str]:
    return _run("--git-dir", str(bare), "log", "--format=%s", "main").splitlines()


def test_two_writers_from_the_same_version_one_applies_the_other_is_stale(
    target: GitTarget,
) -> None:
    v1 = _seed(target, "acme.json", {"limit": 1})
    first = target.write(
        "acme.json", {"limit": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    second = target.write(
        "acme.json", {"limit": 3}, expected_version=v1, fence=3, idempotency_key=_key()
    )
    assert first.outcome is Outcome.APPLIED and first.version not in (None, v1)
    assert second.outcome is Outcome.STALE and second.current is not None
    assert (second.current.document, second.current.version) == ({"limit": 2}, first.version)
    assert target.read("acme.json").document == {"limit": 2}


def test_concurrent_writers_of_one_file_exactly_one_applies(target: GitTarget, bare: Path) -> None:
    v1 = _seed(target, "acme.json", {"n": 0})
    start = threading.Barrier(6)
    results: list[Any] = []

    def writer(i: int) -> None:
        start.wait()
        results.append(
            target.write(
                # i + 1: a blob id is the content's hash, so writing the seed's own
                # document {"n": 0} back would leave the version where it was.
                "acme.json",
                {"n": i + 1},
                expected_version=v1,
                fence=10 + i,
                idempotency_key=_key(),
            )
        )

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    applied = [r for r in results if r.applied]
    assert len(applied) == 1, results
    assert all(r.outcome in (Outcome.STALE, Outcome.FENCED) for r in results if not r.applied)
    assert target.read("acme.json").version == applied[0].version
    assert len(_commits(bare)) == 2  # the create and the one write that won


def test_concurrent_writers_of_different_files_all_apply(target: GitTarget, bare: Path) -> None:
    start = threading.Barrier(6)
    results: list[Any] = []

    def creator(i: int) -> None:
        start.wait()
        results.append(target.create(f"t{i}.json", {"i": i}, fence=1, idempotency_key=_key()))

    threads = [threading.Thread(target=creator, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.outcome for r in results] == [Outcome.APPLIED] * 6, results
    assert all(target.read(f"t{i}.json").document == {"i": i} for i in range(6))
    assert len(_commits(bare)) == 6


def test_a_commit_elsewhere_in_the_window_is_rebased_not_a_conflict(
    target: GitTarget, bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1 = _seed(target, "acme.json", {"limit": 1})
    build = target._build_commit
    calls: list[str | None] = []

    def build_then_someone_commits(**kwargs: Any) -> str:
        commit = build(**kwargs)
        calls.append(kwargs["head"])
        if len(calls) == 1:  # the branch moves after our commit was built on the old head
            _someone_commits(bare, tmp_path, "README.md", "hello\n")
        return commit

    monkeypatch.setattr(target, "_build_commit", build_then_someone_commits)
    result = target.write(
        "acme.json", {"limit": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    assert result.outcome is Outcome.APPLIED
    assert len(calls) == 2 and calls[0] != calls[1]  # built again on the new head
    assert _commits(bare) == [
        "airlock: update tenants/acme.json",
        "someone edits README.md",
        "airlock: create tenants/acme.json",
    ]
    assert _run("--git-dir", str(bare), "show", "main:README.md") == "hello"
    assert target.read("acme.json").document == {"limit": 2}


def test_a_change_to_the_same_file_in_the_window_is_stale(
    target: GitTarget, bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1 = _seed(target, "acme.json", {"limit": 1})
    build = target._build_commit

    def build_then_someone_edits_the_file(**kwargs: Any) -> str:
        commit = build(**kwargs)
        _someone_commits(bare, tmp_path, "tenants/acme.json", '{"limit": 50}\n')
        return commit

    monkeypatch.setattr(target, "_build_commit", build_then_someone_edits_the_file)
    result = target.write(
        "acme.json", {"limit": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    assert result.outcome is Outcome.STALE
    assert result.current is not None and result.current.document == {"limit": 50}
    assert target.read("acme.json").document == {"limit": 50}  # theirs, not overwritten


def test_create_if_absent_race_one_wins(target: GitTarget) -> None:
    start = threading.Barrier(5)
    results: list[Any] = []

    def creator(i: int) -> None:
        start.wait()
        results.append(target.create("new.json", {"by": i}, fence=1, idempotency_key=_key()))

    threads = [threading.Thread(target=creator, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len([r for r in results if r.applied]) == 1
    held = target.read("new.json")
    assert all(r.current == held for r in results if not r.applied)


def test_delete_is_conditional_and_settles(target: GitTarget) -> None:
    v1 = _seed(target, "gone.yaml", {"a": 1})
    v2 = target.write(
        "gone.yaml", {"a": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    ).version
    assert v2 is not None
    stale = target.delete("gone.yaml", expected_version=v1, fence=3, idempotency_key=_key())
    assert (
        stale.outcome is Outcome.STALE
        and stale.current is not None
        and stale.current.document == {"a": 2}
    )
    assert target.delete("gone.yaml", expected_version=v2, fence=3, idempotency_key=_key()).applied
    assert target.read("gone.yaml") == ABSENT
    assert settle_by_reading(
        target, "gone.yaml", written_document=None, observed_version=v2, deleted=True
    ) == Applied(None)


def test_settle_by_reading_applied_not_applied_and_conflict(target: GitTarget) -> None:
    v1 = _seed(target, "s.json", {"x": 1})
    assert isinstance(
        settle_by_reading(target, "s.json", written_document={"x": 2}, observed_version=v1),
        NotApplied,
    )
    written = target.write("s.json", {"x": 2}, expected_version=v1, fence=2, idempotency_key=_key())
    # The worker died here: the branch moved, Airlock recorded nothing.
    assert settle_by_reading(
        target, "s.json", written_document={"x": 2}, observed_version=v1
    ) == Applied(written.version)
    assert written.version is not None
    target.write(
        "s.json", {"x": 7}, expected_version=written.version, fence=3, idempotency_key=_key()
    )
    settled = settle_by_reading(target, "s.json", written_document={"x": 2}, observed_version=v1)
    assert isinstance(settled, Conflict) and settled.current.document == {"x": 7}


def test_a_lower_fence_is_refused_on_the_current_version(target: GitTarget) -> None:
    v1 = _seed(target, "f.json", {"n": 1})
    new = target.write("f.json", {"n": 2}, expected_version=v1, fence=9, idempotency_key=_key())
    assert new.applied and new.version is not None
    zombie = target.write(
        "f.json", {"n": 3}, expected_version=new.version, fence=4, idempotency_key=_key()
    )
    assert zombie.outcome is Outcome.FENCED and target.read("f.json").document == {"n": 2}
    assert target.write(
        "f.json", {"n": 3}, expected_version=new.version, fence=10, idempotency_key=_key()
    ).applied


def test_commit_messages_name_the_run_action_and_approver(target: GitTarget, bare: Path) -> None:
    target.create(
        "m.json",
        {"a": 1},
        fence=3,
        idempotency_key="airlock-action-42",
        message_context={"run": "run-7", "action": "act-42", "approver": "alice\nInjected: yes"},
    )
    body = _run("--git-dir", str(bare), "log", "-1", "--format=%B", "main")
    assert "Airlock-Run: run-7" in body and "Airlock-Action: act-42" in body
    assert "Approved-by: alice Injected: yes" in body and "\nInjected" not in body
    assert "Airlock-Fence: 3" in body and "Airlock-Idempotency-Key: airlock-action-42" in body
    author = _run("--git-dir", str(bare), "log", "-1", "--format=%an <%ae>", "main")
    assert author == "Airlock <airlock@localhost>"


def test_yaml_files_and_a_non_bare_repository(tmp_path: Path) -> None:
    repo = tmp_path / "work"
    _run("init", "--quiet", "--initial-branch=main", str(repo))
    (repo / "svc.yml").write_text("replicas: 2\nimage: web:1\n")
    _run("add", ".", cwd=repo)
    _run("commit", "--quiet", "-m", "start", cwd=repo)
    # The checked-out branch would be left behind by update-ref: govern another branch.
    _run("branch", "airlock", cwd=repo)
    target = GitTarget(GitSettings.from_settings({"repository": str(repo), "branch": "airlock"}))
    snapshot = target.read("svc.yml")
    assert snapshot.document == {"replicas": 2, "image": "web:1"}
    assert snapshot.version == _run("rev-parse", "main:svc.yml", cwd=repo)
    assert snapshot.version is not None
    result = target.write(
        "svc.yml",
        {"replicas": 3, "image": "web:1"},
        expected_version=snapshot.version,
        fence=1,
        idempotency_key=_key(),
    )
    assert result.applied
    assert yaml.safe_load(_run("show", "airlock:svc.yml", cwd=repo)) == {
        "replicas": 3,
        "image": "web:1",
    }
    assert (
        repo / "svc.yml"
    ).read_text() == "replicas: 2\nimage: web:1\n"  # the work tree untouched


@pytest.mark.parametrize(
    "name",
    [
        "notes.txt",
        "../escape.json",
        "a/../b.json",
        ".git/config.json",
        "/abs.json",
        "a//b.json",
        "x y.json",
    ],
)
def test_names_that_cannot_be_a_document_file_are_refused(target: GitTarget, name: str) -> None:
    with pytest.raises(TargetError):
        target.read(name)
    assert target.create(name, {"a": 1}, fence=1, idempotency_key=_key()).outcome is Outcome.FAILED


def test_a_file_that_is_not_a_document_is_an_error_on_read(
    target: GitTarget, bare: Path, tmp_path: Path
) -> None:
    _seed(target, "ok.json", {"a": 1})
    _someone_commits(bare, tmp_path, "tenants/broken.json", "{not json")
    _someone_commits(bare, tmp_path, "tenants/dated.yaml", "when: 2024-01-01\n")
    for name in ("broken.json", "dated.yaml"):
        with pytest.raises(TargetError, match="not a valid document"):
            target.read(name)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"repository": "ssh://host/x.git", "mirror": "/m"}, "ssh_key_env"),
        ({"repository": "git@github.com:x/y.git", "mirror": "/m"}, "ssh_key_env"),
        ({"repository": "git://host/x.git", "mirror": "/m"}, "ssh:// URL"),
        ({"repository": "https://u:p@host/x.git", "mirror": "/m"}, "no user or password"),
        ({"repository": "https://host/x.git"}, "mirror"),
        ({"repository": "https://host/x.git", "mirror": "m"}, "mirror"),
        ({"repository": "file:///x.git", "mirror": "/m", "credentials_env": "X"}, "only for http"),
        (
            {"repository": "https://host/x.git", "mirror": "/m", "credentials_env": "a b"},
            "credentials_env",
        ),
        ({"repository": "/r", "mirror": "/m"}, "only for a remote"),
        ({"repository": "relative/path"}, "absolute"),
        ({"repository": "/r", "branch": "a..b"}, "branch"),
        ({"repository": "/r", "branch": "-x; rm"}, "branch"),
        ({"repository": "/r", "path_prefix": "../up"}, "path_prefix"),
        ({"repository": "/r", "author_name": "x\ny"}, "author_name"),
        ({"repository": "/r", "password": "p"}, "unknown setting"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(TargetConfigError, match=message):
        GitSettings.from_settings(settings)


def test_a_missing_repository_fails_without_writing(tmp_path: Path) -> None:
    target = GitTarget(GitSettings.from_settings({"repository": str(tmp_path / "nope")}))
    assert target.create("a.json", {}, fence=1, idempotency_key=_key()).outcome is Outcome.FAILED
    with pytest.raises(TargetError):
        target.read("a.json")


def test_a_branch_that_keeps_moving_is_locked_not_forced(
    target: GitTarget, bare: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1 = _seed(target, "busy.json", {"n": 1})
    build = target._build_commit
    rounds: list[int] = []

    def build_then_someone_commits_every_time(**kwargs: Any) -> str:
        commit = build(**kwargs)
        rounds.append(1)
        _someone_commits(bare, tmp_path, f"other-{len(rounds)}.txt", "x\n")
        return commit

    monkeypatch.setattr(target, "_build_commit", build_then_someone_commits_every_time)
    result = target.write(
        "busy.json", {"n": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    assert result.outcome is Outcome.LOCKED and len(rounds) == 8
    assert target.read("busy.json") == Snapshot({"n": 1}, v1)  # nothing of ours landed


# -- an http(s) remote with credentials: Apache httpd + git-http-backend (Debian's) ---------

GIT_ENV = "AIRLOCK_TEST_GIT_CREDENTIALS"


@pytest.fixture
def http_remote() -> Iterator[tuple[str, Path, Callable[[], None]]]:
    """A bare repository served by git-http-backend behind Apache with Basic auth."""
    if not HAVE_GIT_HTTP:
        pytest.skip(GIT_HTTP_SKIP)
    with served_repository() as (url, served, server):
        yield url, served, server.stop


def test_an_http_remote_with_credentials_that_never_leak(
    http_remote: tuple[str, Path, Callable[[], None]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, served, stop = http_remote
    caplog.set_level(logging.DEBUG)
    mirror = tmp_path / "mirror.git"
    target = GitTarget(
        GitSettings.from_settings(
            {"repository": url, "mirror": str(mirror), "credentials_env": GIT_ENV}
        )
    )
    monkeypatch.setenv(GIT_ENV, f"{GIT_USER}:{GIT_PASSWORD}")
    created = target.create("a.json", {"a": 1}, fence=1, idempotency_key=_key())
    assert created.applied and created.version is not None
    written = target.write(
        "a.json", {"a": 2}, expected_version=created.version, fence=2, idempotency_key=_key()
    )
    stale = target.write(
        "a.json", {"a": 3}, expected_version=created.version, fence=3, idempotency_key=_key()
    )
    assert written.applied and stale.outcome is Outcome.STALE
    assert _run("--git-dir", str(served), "show", "main:a.json") == '{\n  "a": 2\n}'
    monkeypatch.setenv(GIT_ENV, f"{GIT_USER}:wrong-{GIT_PASSWORD}")
    refused = target.write(
        "a.json", {"a": 4}, expected_version=str(written.version), fence=4, idempotency_key=_key()
    )
    assert refused.outcome is Outcome.FAILED and "Authentication failed" in refused.detail
    with pytest.raises(TargetError) as raised:
        target.read("a.json")
    stop()  # the server is down: nothing is sent, retry later
    monkeypatch.setenv(GIT_ENV, f"{GIT_USER}:{GIT_PASSWORD}")
    down = target.write(
        "a.json", {"a": 4}, expected_version=str(written.version), fence=4, idempotency_key=_key()
    )
    assert down.outcome is Outcome.NOT_SENT, down
    texts = [
        repr(created),
        repr(written),
        repr(stale),
        repr(refused),
        str(raised.value),
        repr(down),
    ]
    texts += [repr(target.settings), caplog.text]
    for text in texts:
        assert GIT_PASSWORD not in text, text
    for path in mirror.rglob("*"):  # nothing of it is kept on disk either
        if path.is_file():
            assert GIT_PASSWORD.encode() not in path.read_bytes(), path
