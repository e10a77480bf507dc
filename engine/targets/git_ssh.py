"""ssh access to a remote git repository (issue 39): the URL rules, the `ssh` command git
runs, and what ssh's complaints mean.

A kind names environment variables, never their values: `ssh_known_hosts_env` (the
known_hosts line(s) pinning the server's host key) and either `ssh_key_env` (the private key's
text; with `ssh_key_passphrase_env` when a passphrase protects it) or `ssh_agent_env` (the
path of an ssh-agent's socket, like SSH_AUTH_SOCK). For each fetch or push the key and the
pinned lines are written to a private directory (0700, files 0600; in /dev/shm when it is
there, so in memory) and removed when git returns. git gets them through `GIT_SSH_COMMAND`:

    ssh -F /dev/null -i <key> -o IdentitiesOnly=yes -o IdentityAgent=none -o BatchMode=yes
        -o StrictHostKeyChecking=yes -o UserKnownHostsFile=<pinned> -o GlobalKnownHostsFile=
        /dev/null -o UpdateHostKeys=no -o ConnectTimeout=<half the kind's timeout>

A passphrase: BatchMode=yes would forbid asking for it, so it is replaced by
PreferredAuthentications=publickey, PasswordAuthentication=no, KbdInteractiveAuthentication=no
and NumberOfPasswordPrompts=1, and ssh asks an askpass program in the private directory
(SSH_ASKPASS, SSH_ASKPASS_REQUIRE=force, OpenSSH >= 8.4) that prints the passphrase from
git's child environment — never a command line or a file. An agent: `-o IdentityAgent=<socket>
-o IdentitiesOnly=no -o IdentityFile=none` instead of the key (the agent's keys, not the
worker's ~/.ssh/id_*), BatchMode=yes kept.

Host key checking is never off: only the pinned lines are trusted (not ~/.ssh, not /etc/ssh),
an unknown or changed host key is refused, nothing is ever added. `-F /dev/null` keeps the
worker's own ssh config (a ProxyCommand, another identity) out of it.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from engine.targets import base
from engine.targets.base import (
    TargetError,
    child_environment,
    read_credentials,
    write_private_file,
)

# Where the key and the pinned host keys (and an https remote's TLS files, git_remote.py)
# live while git runs: the shared scratch place, here so that a test can move it for git.
SCRATCH: str | None = base.SCRATCH

_USER = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,63}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+\])$")
# git's scp-like syntax, `user@host:path` (no slash before the colon); the user is required.
_SCP = re.compile(r"^(?P<user>[^@/:\s]+)@(?P<host>[^@/:\s]+):(?P<path>[^\x00-\x1f]+)$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# The line `SshSession.explain` adds when the passphrase does not open the key: nothing was
# sent (the handshake stopped at our own key), a deployment error to fix and retry.
WRONG_PASSPHRASE = "airlock: the passphrase"
# ssh lines saying the connection never got as far as sending anything.
UNREACHABLE = (
    WRONG_PASSPHRASE,
    "ssh: connect to host",  # ... Connection refused / timed out / No route to host
    "ssh: Could not resolve hostname",
    "kex_exchange_identification",  # the server hung up before the handshake
    "Network is unreachable",
    "No route to host",
)
ASKPASS_VARIABLE = "AIRLOCK_SSH_PASSPHRASE"
# Without BatchMode (so that ssh asks the askpass), every other prompt stays impossible.
_PASSPHRASE_ONLY = (
    "-o",
    "PreferredAuthentications=publickey",
    "-o",
    "PasswordAuthentication=no",
    "-o",
    "KbdInteractiveAuthentication=no",
    "-o",
    "NumberOfPasswordPrompts=1",
)
REFUSED = (
    "Host key verification failed",  # an unknown or changed host key: never written
    "Permission denied (",  # our key was not accepted
)


def is_ssh_url(url: str) -> bool:
    return url.startswith("ssh://") or ("://" not in url and _SCP.match(url) is not None)


def check_ssh_url(url: str) -> str:
    """ "" or why `url` cannot be an ssh remote (a password in it, an odd host or user)."""
    if url.startswith("ssh://"):
        try:
            parts = urlsplit(url)
            _ = parts.port  # raises ValueError for a port that is not one
        except ValueError:
            return "repository: not a valid ssh:// URL"
        if parts.password is not None:
            return "repository: no password in the URL — name ssh_key_env instead"
        user, host, path = parts.username, parts.hostname or "", parts.path
        if "[" in parts.netloc:
            host = f"[{host}]"
        if parts.query or parts.fragment:
            return "repository: an ssh:// URL has no query or fragment"
    else:
        match = _SCP.match(url)
        if match is None:
            return "repository: an ssh remote is ssh://[user@]host[:port]/path or user@host:path"
        user, host, path = match["user"], match["host"], match["path"]
    if user is not None and not _USER.match(user):
        return "repository: the ssh user is letters, digits, '.', '_' or '-'"
    if not _HOST.match(host):
        return "repository: the ssh host is a plain host name or address"
    if not path or path == "/" or _CONTROL.search(path) or path.startswith("-"):
        return "repository: the URL names no repository path"
    return ""


@dataclass(frozen=True)
class SshSession:
    """What one fetch or push needs: git's child environment, the secrets to scrub from what
    git prints, and `explain` to name a wrong passphrase (ssh itself only says it was refused)."""

    env: dict[str, str] = field(repr=False)
    secrets: list[str] = field(repr=False)
    key_file: Path | None = None
    key_env: str = ""
    passphrase_env: str | None = None

    def explain(self, stderr: str) -> str:
        """`stderr`, plus a line saying the passphrase does not open the key when ssh was
        refused and that is why: checked locally with `ssh-keygen -y` through the same
        askpass, only after a refusal (the happy path pays for no second key derivation)."""
        if (
            self.passphrase_env is None
            or self.key_file is None
            or "Permission denied (" not in stderr
        ):
            return stderr
        try:
            check = subprocess.run(
                ["ssh-keygen", "-y", "-f", str(self.key_file)],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=child_environment(drop_prefix="GIT_") | self.env,
                timeout=30,
                check=False,
                start_new_session=True,  # no terminal to ask on: only the askpass
            )
        except (OSError, subprocess.TimeoutExpired):
            return stderr
        if check.returncode == 0:
            return stderr  # the key opens: the server refused it
        return (
            f"{stderr.rstrip()}\n{WRONG_PASSPHRASE} in {self.passphrase_env} does not decrypt "
            f"the key in {self.key_env}\n"
        )


@contextmanager
def ssh_access(
    *,
    key_env: str | None,
    known_hosts_env: str,
    timeout: float,
    passphrase_env: str | None = None,
    agent_env: str | None = None,
) -> Iterator[SshSession]:
    """The ssh session for one git command: this key (or the agent's keys) and only these
    host keys trusted; the files exist until the block ends. A variable this worker does not
    have, or an agent socket that is not there, raises TargetError before anything runs."""
    known = read_credentials(known_hosts_env).replace("\r\n", "\n").strip() + "\n"
    key = agent = passphrase = None
    if agent_env is not None:
        agent = _agent_socket(agent_env)
    elif key_env is not None:
        key = read_credentials(key_env).replace("\r\n", "\n").strip() + "\n"
        if passphrase_env is not None:
            passphrase = read_credentials(passphrase_env)
    else:
        raise TargetError("an ssh remote needs ssh_key_env or ssh_agent_env")
    with ExitStack() as stack:
        scratch = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="airlock-ssh-", dir=SCRATCH)
        )
        hosts_file = write_private_file(Path(scratch) / "known_hosts", known)
        env = {"GIT_SSH_VARIANT": "ssh"}
        if agent is not None:
            # The agent's keys, and only those: no key file, not the worker's ~/.ssh/id_*.
            who = ["-o", f"IdentityAgent={agent}", "-o", "IdentitiesOnly=no"]
            who += ["-o", "IdentityFile=none", "-o", "BatchMode=yes"]
            key_file = None
        else:
            key_file = write_private_file(Path(scratch) / "id", key or "")
            who = ["-i", str(key_file), "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none"]
            if passphrase is None:
                who += ["-o", "BatchMode=yes"]
            else:
                # BatchMode=yes forbids every prompt, the askpass too; without it the only
                # prompt left is the key's passphrase: no password or keyboard-interactive
                # login to answer (the askpass would hand them the passphrase), host keys
                # strict (no yes/no question), one try.
                who += _PASSPHRASE_ONLY
                env |= {
                    "SSH_ASKPASS": _askpass(scratch, stack),
                    "SSH_ASKPASS_REQUIRE": "force",
                    ASKPASS_VARIABLE: passphrase,
                }
        command = [
            "ssh",
            "-F",
            "/dev/null",
            *who,
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={hosts_file}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "UpdateHostKeys=no",
            "-o",
            f"ConnectTimeout={max(1, math.ceil(timeout / 2))}",
        ]
        env["GIT_SSH_COMMAND"] = shlex.join(command)
        secrets = [*_key_secrets(key), *([passphrase] if passphrase else [])] if key else []
        yield SshSession(
            env=env,
            secrets=secrets,
            key_file=key_file,
            key_env=key_env or "",
            passphrase_env=passphrase_env,
        )


def _askpass(scratch: str, stack: ExitStack) -> str:
    """The askpass program: it prints the passphrase from git's child environment (the only
    place it is), so the file holds no secret. In the scratch directory unless that is on a
    noexec mount (a hardened /dev/shm), then in a private directory of its own."""
    where = scratch
    if os.statvfs(scratch).f_flag & os.ST_NOEXEC:
        where = stack.enter_context(tempfile.TemporaryDirectory(prefix="airlock-askpass-"))
    path = Path(where) / "askpass"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
    with os.fdopen(fd, "w") as out:
        out.write(f"#!/bin/sh\nprintf '%s\\n' \"${ASKPASS_VARIABLE}\"\n")
    return str(path)


def _agent_socket(agent_env: str) -> str:
    """The agent's socket path from the variable: absolute, plain (ssh expands `%` and `$`
    in IdentityAgent), and a socket that is there — else nothing can be sent."""
    path = read_credentials(agent_env)
    if not os.path.isabs(path) or re.search(r"[\s%$\"'\\]", path) or _CONTROL.search(path):
        raise TargetError(f"the ssh agent socket in {agent_env}: not a plain absolute path")
    try:
        is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        raise TargetError(f"the ssh agent socket in {agent_env} is not there on this worker")
    return path


def _key_secrets(key: str) -> list[str]:
    """The key's text and each line of its body, to scrub from anything git printed."""
    lines = [line.strip() for line in key.splitlines()]
    return [key, *(line for line in lines if line and not line.startswith("-----"))]


def ssh_complaint(stderr: str) -> tuple[bool, str] | None:
    """(unreachable?, the line) when ssh says nothing was sent — it could not connect, our
    passphrase does not open our key, or the server's host key or our key was refused —
    else None."""
    for line in stderr.splitlines():
        if line.startswith(WRONG_PASSPHRASE):
            return True, line.removeprefix("airlock: ")
    for line in stderr.splitlines():
        text = line.strip().removeprefix("fatal: ")
        if any(sign in text for sign in UNREACHABLE):
            return True, text
        if any(sign in text for sign in REFUSED):
            return False, text
    return None
