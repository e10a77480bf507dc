"""An ssh git remote's identity beyond a plain key (issue 39), against the real OpenSSH server
of tests/fixtures/sshd.py: a key protected by a passphrase (`ssh_key_passphrase_env`, read by
ssh through an askpass program), an ssh-agent started by the test (`ssh_agent_env`), unset
variables (nothing sent, retried) and the settings rules.

The key, the passphrase and the agent's socket are named by environment variables; the key's
text and the passphrase must show in no result, error or log record.
"""

from __future__ import annotations

import base64
import logging
import os
import shlex
import shutil
import signal
import socket as sockets
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.targets import git_ssh
from engine.targets.base import Outcome, TargetConfigError, TargetError
from engine.targets.git import GitSettings, GitTarget
from engine.targets.git_remote import RemoteUnreachable
from tests.fixtures.sshd import SshServer

KEY_ENV, HOSTS_ENV = "AIRLOCK_TEST_SSH_KEY", "AIRLOCK_TEST_SSH_KNOWN_HOSTS"
PASS_ENV, AGENT_ENV = "AIRLOCK_TEST_SSH_PASSPHRASE", "AIRLOCK_TEST_SSH_AGENT"
PASSPHRASE = "correct horse battery staple"
HAVE_AGENT = shutil.which("ssh-agent") is not None and shutil.which("ssh-add") is not None


def _run(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout.strip()


def _key() -> str:
    return f"airlock-action-{uuid.uuid4()}"


def _target(sshd: SshServer, served: Path, mirror: Path, **names: str) -> GitTarget:
    return GitTarget(
        GitSettings.from_settings(
            {
                "repository": sshd.url(served),
                "mirror": str(mirror),
                "ssh_known_hosts_env": HOSTS_ENV,
                "branch": "main",
                "path_prefix": "tenants/",
                "timeout": 10,
                **names,
            }
        )
    )


def _commits(served: Path) -> str:
    return _run("--git-dir", str(served), "rev-list", "--count", "main")


def _nothing_pushed(served: Path) -> None:
    assert _run("--git-dir", str(served), "branch", "--list") == ""


def _no_secret_in(texts: list[str], *secrets: str) -> None:
    pieces = [s for secret in secrets for s in (secret, *secret.splitlines()) if len(s) > 8]
    for text in texts:
        for piece in pieces:
            if not piece.startswith("-----"):
                assert piece not in text, text


@pytest.fixture
def locked_key(sshd: SshServer, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A key the server accepts, protected by PASSPHRASE; its text in KEY_ENV."""
    private, _ = sshd.authorised_key(PASSPHRASE)
    body = base64.b64decode("".join(private.strip().splitlines()[1:-1]))
    assert b"bcrypt" in body  # the key is really encrypted (its KDF is named)
    monkeypatch.setenv(KEY_ENV, private)
    monkeypatch.setenv(HOSTS_ENV, sshd.known_hosts)
    monkeypatch.setenv(PASS_ENV, PASSPHRASE)
    return private


def test_a_key_with_its_passphrase_writes_once_and_reads(
    sshd: SshServer, served: Path, scratch: Path, tmp_path: Path, locked_key: str
) -> None:
    target = _target(
        sshd,
        served,
        tmp_path / "mirror.git",
        ssh_key_env=KEY_ENV,
        ssh_key_passphrase_env=PASS_ENV,
    )
    created = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert created.applied and created.version is not None, created
    written = target.write(
        "acme.json", {"limit": 2}, expected_version=created.version, fence=2, idempotency_key=_key()
    )
    assert written.applied, written
    assert _commits(served) == "2"  # one commit per applied write
    other = _target(
        sshd, served, tmp_path / "other.git", ssh_key_env=KEY_ENV, ssh_key_passphrase_env=PASS_ENV
    )
    assert other.read("acme.json").document == {"limit": 2}
    assert list(scratch.iterdir()) == []  # key, pinned hosts and askpass gone
    _no_secret_in([repr(created), repr(written), repr(target.settings)], locked_key, PASSPHRASE)
    # Without the passphrase setting the same key cannot be used (ssh never asks in batch).
    plain = _target(sshd, served, tmp_path / "plain.git", ssh_key_env=KEY_ENV)
    with pytest.raises(TargetError, match="Permission denied"):
        plain.read("acme.json")


def test_a_wrong_passphrase_is_not_sent_and_shows_nowhere(
    sshd: SshServer,
    served: Path,
    scratch: Path,
    tmp_path: Path,
    locked_key: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "not the passphrase at all"
    monkeypatch.setenv(PASS_ENV, wrong)
    target = _target(
        sshd, served, tmp_path / "mirror.git", ssh_key_env=KEY_ENV, ssh_key_passphrase_env=PASS_ENV
    )
    refused = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert refused.outcome is Outcome.NOT_SENT, refused  # retried: fix the variable, restart
    assert f"the passphrase in {PASS_ENV} does not decrypt the key in {KEY_ENV}" in refused.detail
    with pytest.raises(RemoteUnreachable, match="does not decrypt") as raised:
        target.read("acme.json")
    _nothing_pushed(served)
    assert list(scratch.iterdir()) == []
    texts = [repr(refused), str(raised.value), caplog.text, sshd.log()]
    _no_secret_in(texts, locked_key, PASSPHRASE, wrong)


@pytest.mark.parametrize("unset", [KEY_ENV, HOSTS_ENV, PASS_ENV])
def test_an_unset_variable_is_not_sent_and_retried(
    sshd: SshServer,
    served: Path,
    tmp_path: Path,
    locked_key: str,
    unset: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(unset)
    target = _target(
        sshd, served, tmp_path / "mirror.git", ssh_key_env=KEY_ENV, ssh_key_passphrase_env=PASS_ENV
    )
    result = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert result.outcome is Outcome.NOT_SENT, result  # like an unset credentials_env on https
    assert f"{unset} is not set on this worker" in result.detail
    with pytest.raises(RemoteUnreachable, match=unset):
        target.read("acme.json")
    _nothing_pushed(served)


@dataclass
class Agent:
    socket: str
    pid: int

    def add(self, key_file: Path) -> None:
        subprocess.run(
            ["ssh-add", "-q", str(key_file)],
            env={**os.environ, "SSH_AUTH_SOCK": self.socket},
            check=True,
            capture_output=True,
            stdin=subprocess.DEVNULL,
        )


@pytest.fixture
def agent(sshd: SshServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    """`ssh-agent -a <socket>`, holding no key yet; killed (by its pid) at teardown. Its
    socket is only in AGENT_ENV: not SSH_AUTH_SOCK, which the adapter must not use."""
    if not HAVE_AGENT:
        pytest.skip("ssh-agent / ssh-add are not installed")
    home = tempfile.mkdtemp(prefix="airlock-agent-")  # short: a socket path has 108 bytes
    socket = f"{home}/agent.sock"
    started = subprocess.run(
        ["ssh-agent", "-a", socket], check=True, capture_output=True, text=True
    ).stdout
    pid = int(started.split("SSH_AGENT_PID=", 1)[1].split(";", 1)[0])
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setenv(AGENT_ENV, socket)
    monkeypatch.setenv(HOSTS_ENV, sshd.known_hosts)
    try:
        yield Agent(socket, pid)
    finally:
        os.kill(pid, signal.SIGTERM)
        shutil.rmtree(home, ignore_errors=True)


def test_an_agent_holding_the_key_writes_once(
    sshd: SshServer, served: Path, scratch: Path, tmp_path: Path, agent: Agent
) -> None:
    _, key_file = sshd.authorised_key()
    agent.add(key_file)
    target = _target(sshd, served, tmp_path / "mirror.git", ssh_agent_env=AGENT_ENV)
    created = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert created.applied and created.version is not None, created
    written = target.write(
        "acme.json", {"limit": 2}, expected_version=created.version, fence=2, idempotency_key=_key()
    )
    stale = target.write(
        "acme.json", {"limit": 3}, expected_version=created.version, fence=3, idempotency_key=_key()
    )
    assert written.applied and stale.outcome is Outcome.STALE, (written, stale)
    assert _commits(served) == "2"
    assert list(scratch.iterdir()) == []


def test_an_agent_without_the_key_is_refused_and_a_missing_one_is_not_sent(
    sshd: SshServer,
    served: Path,
    tmp_path: Path,
    agent: Agent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = _target(sshd, served, tmp_path / "mirror.git", ssh_agent_env=AGENT_ENV)
    empty = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert empty.outcome is Outcome.FAILED, empty  # the server refused what it was offered
    assert "Permission denied (publickey)" in empty.detail
    monkeypatch.setenv(AGENT_ENV, f"{agent.socket}.gone")  # the agent is not running
    gone = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert gone.outcome is Outcome.NOT_SENT, gone
    assert f"the ssh agent socket in {AGENT_ENV} is not there" in gone.detail
    monkeypatch.setenv(AGENT_ENV, "relative/agent.sock")
    odd = target.create("acme.json", {"limit": 1}, fence=1, idempotency_key=_key())
    assert odd.outcome is Outcome.NOT_SENT and "not a plain absolute path" in odd.detail
    _nothing_pushed(served)


def _options(command: list[str]) -> dict[str, str]:
    pairs = (command[i + 1].split("=", 1) for i, word in enumerate(command) if word == "-o")
    return dict((name, value) for name, value in pairs)


def test_the_passphrase_reaches_only_the_askpass_through_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(git_ssh, "SCRATCH", str(tmp_path))
    monkeypatch.setenv(KEY_ENV, "-----BEGIN KEY-----\nc2VjcmV0LWtleS1ib2R5\n-----END KEY-----")
    monkeypatch.setenv(HOSTS_ENV, "[h]:2222 ssh-ed25519 AAAA")
    monkeypatch.setenv(PASS_ENV, PASSPHRASE)
    with git_ssh.ssh_access(
        key_env=KEY_ENV, known_hosts_env=HOSTS_ENV, timeout=10, passphrase_env=PASS_ENV
    ) as ssh:
        command = shlex.split(ssh.env["GIT_SSH_COMMAND"])
        options = _options(command)
        assert "BatchMode" not in options  # it would forbid the askpass too
        assert options["PasswordAuthentication"] == "no"
        assert options["KbdInteractiveAuthentication"] == "no"
        assert options["PreferredAuthentications"] == "publickey"
        assert options["NumberOfPasswordPrompts"] == "1"
        assert options["StrictHostKeyChecking"] == "yes" and options["IdentitiesOnly"] == "yes"
        assert options["IdentityAgent"] == "none"
        askpass = Path(ssh.env["SSH_ASKPASS"])
        assert askpass.parent == Path(command[command.index("-i") + 1]).parent
        assert stat.S_IMODE(askpass.stat().st_mode) == 0o700
        assert ssh.env["SSH_ASKPASS_REQUIRE"] == "force"
        assert [k for k, v in ssh.env.items() if PASSPHRASE in v] == [git_ssh.ASKPASS_VARIABLE]
        for path in askpass.parent.iterdir():
            assert PASSPHRASE not in path.read_text()
        said = subprocess.run(
            [str(askpass), "Enter passphrase"], env=ssh.env, capture_output=True, text=True
        )
        assert said.stdout == f"{PASSPHRASE}\n"
        assert PASSPHRASE in ssh.secrets
    assert os.listdir(tmp_path) == []


def test_an_agent_replaces_the_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(git_ssh, "SCRATCH", str(tmp_path))
    sock = tmp_path.parent / f"agent-{uuid.uuid4().hex[:8]}.sock"
    server = sockets.socket(sockets.AF_UNIX)
    server.bind(str(sock))
    monkeypatch.setenv(AGENT_ENV, str(sock))
    monkeypatch.setenv(HOSTS_ENV, "[h]:2222 ssh-ed25519 AAAA")
    try:
        with git_ssh.ssh_access(
            key_env=None, known_hosts_env=HOSTS_ENV, timeout=10, agent_env=AGENT_ENV
        ) as ssh:
            command = shlex.split(ssh.env["GIT_SSH_COMMAND"])
            options = _options(command)
            assert "-i" not in command and "SSH_ASKPASS" not in ssh.env
            assert options["IdentityAgent"] == str(sock)
            assert options["IdentityFile"] == "none"  # not the worker's ~/.ssh/id_*
            assert options["IdentitiesOnly"] == "no" and options["BatchMode"] == "yes"
            assert options["StrictHostKeyChecking"] == "yes"
    finally:
        server.close()
        sock.unlink()


SSH = {"repository": "ssh://git@host/x.git", "mirror": "/m", "ssh_known_hosts_env": HOSTS_ENV}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({**SSH, "ssh_key_env": KEY_ENV, "ssh_agent_env": AGENT_ENV}, "not both"),
        (SSH, "ssh_key_env or ssh_agent_env: an ssh remote needs one"),
        ({**SSH, "ssh_key_passphrase_env": PASS_ENV}, "ssh_key_env or ssh_agent_env"),
        (
            {**SSH, "ssh_agent_env": AGENT_ENV, "ssh_key_passphrase_env": PASS_ENV},
            "ssh_key_passphrase_env: only with ssh_key_env",
        ),
        ({**SSH, "ssh_agent_env": "/run/agent.sock"}, "ssh_agent_env: the name of"),
        (
            {**SSH, "ssh_key_env": KEY_ENV, "ssh_key_passphrase_env": "hunter2!"},
            "ssh_key_passphrase_env: the name of",
        ),
        ({**SSH, "repository": "https://h/x.git", "ssh_agent_env": AGENT_ENV}, "only for ssh"),
        (
            {"repository": "file:///x.git", "mirror": "/m", "ssh_key_passphrase_env": PASS_ENV},
            "only for ssh",
        ),
        ({"repository": "/r", "ssh_agent_env": AGENT_ENV}, "only for a remote"),
    ],
)
def test_identity_settings_rules(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(TargetConfigError, match=message):
        GitSettings.from_settings(settings)


def test_an_agent_alone_or_a_key_with_a_passphrase_is_accepted() -> None:
    agent = GitSettings.from_settings({**SSH, "ssh_agent_env": AGENT_ENV})
    assert (agent.ssh_agent_env, agent.ssh_key_env) == (AGENT_ENV, None)
    locked = GitSettings.from_settings(
        {**SSH, "ssh_key_env": KEY_ENV, "ssh_key_passphrase_env": PASS_ENV}
    )
    assert locked.ssh_key_passphrase_env == PASS_ENV
