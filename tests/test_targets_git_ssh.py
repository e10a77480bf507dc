"""The git adapter's ssh remotes (engine/targets/git_ssh.py) against a real OpenSSH server
(tests/fixtures/sshd.py): Debian's sshd on a free port, its own host key, one authorised
client key, the remote a bare repository in tmp_path.

The key and the pinned host key are named by environment variables and must never show up
in a result, an error, the logs or the mirror; host key checking is never off.
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from engine.targets import git_ssh
from engine.targets.base import Outcome, TargetConfigError, TargetError
from engine.targets.git import GitSettings, GitTarget
from engine.targets.git_remote import RemoteUnreachable
from tests.fixtures.sshd import SshServer

KEY_ENV, HOSTS_ENV = "AIRLOCK_TEST_SSH_KEY", "AIRLOCK_TEST_SSH_KNOWN_HOSTS"


def _run(*args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=Someone", "-c", "user.email=someone@example.com", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def _key() -> str:
    return f"airlock-action-{uuid.uuid4()}"


def _key_body(key: str) -> list[str]:
    """The lines of a private key that are the secret (not its BEGIN/END armour)."""
    return [line for line in key.splitlines() if line and not line.startswith("-----")]


@pytest.fixture
def target(
    sshd: SshServer, served: Path, tmp_path: Path, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> GitTarget:
    monkeypatch.setenv(KEY_ENV, sshd.client_key)
    monkeypatch.setenv(HOSTS_ENV, sshd.known_hosts)
    return GitTarget(
        GitSettings.from_settings(
            {
                "repository": sshd.url(served),
                "mirror": str(tmp_path / "mirror.git"),
                "ssh_key_env": KEY_ENV,
                "ssh_known_hosts_env": HOSTS_ENV,
                "branch": "main",
                "path_prefix": "tenants/",
                "timeout": 10,
            }
        )
    )


def _served(repo: Path, name: str) -> str:
    return _run("--git-dir", str(repo), "show", f"main:tenants/{name}")


def _no_secret_in(texts: list[str], key: str) -> None:
    for text in texts:
        for line in _key_body(key):
            assert line not in text, text


def test_a_write_through_ssh_lands_once_and_a_second_from_the_same_version_is_stale(
    target: GitTarget, served: Path, scratch: Path, tmp_path: Path, sshd: SshServer
) -> None:
    created = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert created.applied and created.version is not None, created
    first = target.write(
        "acme.json", {"limit": 2}, expected_version=created.version, fence=2, idempotency_key=_key()
    )
    second = target.write(
        "acme.json", {"limit": 3}, expected_version=created.version, fence=3, idempotency_key=_key()
    )
    assert first.applied, first
    assert second.outcome is Outcome.STALE and second.current is not None, second
    assert (second.current.document, second.current.version) == ({"limit": 2}, first.version)
    # Read back from the remote itself: one commit per applied write, the document ours.
    assert _served(served, "acme.json") == '{\n  "limit": 2\n}'
    assert _run("--git-dir", str(served), "rev-list", "--count", "main") == "2"
    # Another worker with its own mirror reads the same through ssh.
    other = GitTarget(
        GitSettings.from_settings(
            {
                **{k: v for k, v in vars(target.settings).items() if v is not None},
                "mirror": str(tmp_path / "other-mirror.git"),
            }
        )
    )
    assert other.read("acme.json").version == first.version
    assert list(scratch.iterdir()) == []  # the key files are gone once git returned
    _no_secret_in(
        [repr(created), repr(first), repr(second), repr(target.settings)], sshd.client_key
    )


def test_the_remote_moving_between_read_and_push_is_a_lost_lease_not_an_overwrite(
    target: GitTarget, served: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1 = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key()).version
    assert v1 is not None
    build = target._build_commit
    done: list[bool] = []

    def build_then_someone_pushes(**kwargs: Any) -> str:
        commit = build(**kwargs)
        if not done:  # someone else changes the same file on the remote in the window
            done.append(True)
            clone = tmp_path / "clone"
            _run("clone", "--quiet", "--branch", "main", str(served), str(clone))
            (clone / "tenants/acme.json").write_text('{"limit": 9}')
            _run("-C", str(clone), "commit", "--quiet", "-am", "someone")
            _run("-C", str(clone), "push", "--quiet", "origin", "main")
        return commit

    monkeypatch.setattr(target, "_build_commit", build_then_someone_pushes)
    result = target.write(
        "acme.json", {"limit": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    assert result.outcome is Outcome.STALE and result.current is not None, result
    assert result.current.document == {"limit": 9}
    assert _served(served, "acme.json") == '{"limit": 9}'


def test_an_unknown_host_key_is_refused_and_nothing_is_written(
    target: GitTarget,
    sshd: SshServer,
    served: Path,
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(HOSTS_ENV, sshd.stranger_known_hosts())  # pinned: some other server
    created = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert created.outcome is Outcome.FAILED, created
    assert "Host key verification failed" in created.detail
    with pytest.raises(TargetError, match="Host key verification failed") as raised:
        target.read("acme.json")
    assert not isinstance(raised.value, RemoteUnreachable)  # refused for good, not retried
    monkeypatch.setenv(HOSTS_ENV, "# nothing pinned\n")  # no host key known at all
    nothing = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert nothing.outcome is Outcome.FAILED and "Host key verification" in nothing.detail
    assert _run("--git-dir", str(served), "branch", "--list") == ""  # never written
    assert list(scratch.iterdir()) == []
    _no_secret_in([repr(created), str(raised.value), repr(nothing), caplog.text], sshd.client_key)


def test_a_key_the_server_does_not_know_is_refused(
    target: GitTarget,
    sshd: SshServer,
    served: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    stranger = sshd.unknown_key()
    monkeypatch.setenv(KEY_ENV, stranger)
    refused = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert refused.outcome is Outcome.FAILED, refused
    assert "Permission denied (publickey)" in refused.detail
    with pytest.raises(TargetError, match="Permission denied") as raised:
        target.read("acme.json")
    assert not isinstance(raised.value, RemoteUnreachable)
    assert _run("--git-dir", str(served), "branch", "--list") == ""
    _no_secret_in([repr(refused), str(raised.value), caplog.text], stranger)


def test_a_server_that_is_down_is_not_sent_and_never_applied(
    target: GitTarget, sshd: SshServer, served: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1 = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key()).version
    assert v1 is not None
    build = target._build_commit

    def build_then_the_server_dies(**kwargs: Any) -> str:
        commit = build(**kwargs)
        sshd.stop()  # the read worked; the push cannot connect
        return commit

    monkeypatch.setattr(target, "_build_commit", build_then_the_server_dies)
    at_push = target.write(
        "acme.json", {"limit": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    assert at_push.outcome is Outcome.NOT_SENT, at_push  # not unknown: ssh never connected
    assert "Connection refused" in at_push.detail
    monkeypatch.setattr(target, "_build_commit", build)
    at_read = target.write(
        "acme.json", {"limit": 2}, expected_version=v1, fence=2, idempotency_key=_key()
    )
    assert at_read.outcome is Outcome.NOT_SENT, at_read
    with pytest.raises(RemoteUnreachable):
        target.read("acme.json")
    assert _served(served, "acme.json") == '{\n  "limit": 1\n}'


def test_the_ssh_command_pins_the_host_key_and_removes_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(git_ssh, "SCRATCH", str(tmp_path))
    monkeypatch.setenv(KEY_ENV, "-----BEGIN KEY-----\r\nc2VjcmV0LWtleS1ib2R5\r\n-----END KEY-----")
    monkeypatch.setenv(HOSTS_ENV, "[h]:2222 ssh-ed25519 AAAA")
    with git_ssh.ssh_access(key_env=KEY_ENV, known_hosts_env=HOSTS_ENV, timeout=10) as ssh:
        env, secrets = ssh.env, ssh.secrets
        command = shlex.split(env["GIT_SSH_COMMAND"])
        options = dict(
            command[i + 1].split("=", 1) for i, word in enumerate(command) if word == "-o"
        )
        key_file = Path(command[command.index("-i") + 1])
        hosts_file = Path(options["UserKnownHostsFile"])
        assert command[:3] == ["ssh", "-F", "/dev/null"]
        assert options["StrictHostKeyChecking"] == "yes"
        assert options["IdentitiesOnly"] == "yes" and options["BatchMode"] == "yes"
        assert options["GlobalKnownHostsFile"] == "/dev/null"
        assert options["ConnectTimeout"] == "5"
        for path in (key_file, hosts_file):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
        assert (
            key_file.read_text() == "-----BEGIN KEY-----\nc2VjcmV0LWtleS1ib2R5\n-----END KEY-----\n"
        )
        assert "c2VjcmV0LWtleS1ib2R5" in secrets
        assert "c2VjcmV0LWtleS1ib2R5" not in env["GIT_SSH_COMMAND"]
    assert not key_file.exists() and not key_file.parent.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "repository",
    [
        "ssh://git@git.internal/ops/config.git",
        "ssh://git@git.internal:2222/ops/config.git",
        "ssh://git.internal/srv/config.git",
        "ssh://git@[::1]:2222/config.git",
        "git@git.internal:ops/config.git",
    ],
)
def test_ssh_urls_are_accepted_with_both_variables(repository: str) -> None:
    settings = GitSettings.from_settings(
        {
            "repository": repository,
            "mirror": "/m",
            "ssh_key_env": KEY_ENV,
            "ssh_known_hosts_env": HOSTS_ENV,
        }
    )
    assert settings.is_remote and settings.ssh_key_env == KEY_ENV


SSH = {"mirror": "/m", "ssh_key_env": KEY_ENV, "ssh_known_hosts_env": HOSTS_ENV}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({**SSH, "repository": "ssh://git:pw@host/x.git"}, "no password"),
        ({**SSH, "repository": "ssh://-oProxyCommand=x/x.git"}, "host"),
        ({**SSH, "repository": "ssh://-u@host/x.git"}, "user"),
        ({**SSH, "repository": "ssh://git@host:port/x.git"}, "not a valid ssh"),
        ({**SSH, "repository": "ssh://git@host/"}, "no repository path"),
        ({**SSH, "repository": "ssh://git@host/x.git?a=b"}, "query"),
        ({**SSH, "repository": "git@host:-x"}, "no repository path"),
        ({**SSH, "repository": "ssh://git@host/x.git", "credentials_env": "X"}, "only for http"),
        ({"repository": "ssh://git@host/x.git", "mirror": "/m"}, "ssh_key_env"),
        (
            {"repository": "ssh://git@host/x.git", "mirror": "/m", "ssh_key_env": KEY_ENV},
            "ssh_known_hosts_env",
        ),
        ({**SSH, "repository": "ssh://h/x.git", "ssh_key_env": "-----BEGIN"}, "ssh_key_env"),
        ({**SSH, "repository": "https://host/x.git"}, "only for ssh remotes"),
        ({**SSH, "repository": "file:///x.git"}, "only for ssh remotes"),
        ({"repository": "/r", "ssh_key_env": KEY_ENV}, "only for a remote"),
    ],
)
def test_bad_ssh_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(TargetConfigError, match=message):
        GitSettings.from_settings(settings)
