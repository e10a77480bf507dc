"""ssh access to a remote git repository (issue 39): the URL rules, the `ssh` command git
runs, and what ssh's complaints mean.

A kind names two environment variables, never their values: `ssh_key_env` (the private key's
text, unencrypted — there is no one to type a passphrase) and `ssh_known_hosts_env` (the
known_hosts line(s) pinning the server's host key). For each fetch or push both are written
to a private directory (0700, files 0600; in /dev/shm when it is there, so in memory) and
removed when git returns. git gets them through `GIT_SSH_COMMAND` in its environment:

    ssh -F /dev/null -i <key> -o IdentitiesOnly=yes -o IdentityAgent=none -o BatchMode=yes
        -o StrictHostKeyChecking=yes -o UserKnownHostsFile=<pinned> -o GlobalKnownHostsFile=
        /dev/null -o UpdateHostKeys=no -o ConnectTimeout=<half the kind's timeout>

Host key checking is never off: only the pinned lines are trusted (not ~/.ssh, not /etc/ssh),
an unknown or changed host key is refused, nothing is ever added. `-F /dev/null` keeps the
worker's own ssh config (a ProxyCommand, another identity) out of it.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from engine.targets.base import read_credentials

# Where the key and the pinned host keys live while git runs: memory when we can. Only a
# fresh mkdtemp directory (0700) is made in it, never a guessable name.
_SHM = "/dev/shm"  # noqa: S108
SCRATCH: str | None = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else None
_USER = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,63}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+\])$")
# git's scp-like syntax, `user@host:path` (no slash before the colon); the user is required.
_SCP = re.compile(r"^(?P<user>[^@/:\s]+)@(?P<host>[^@/:\s]+):(?P<path>[^\x00-\x1f]+)$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# ssh lines saying the connection never got as far as sending anything.
UNREACHABLE = (
    "ssh: connect to host",  # ... Connection refused / timed out / No route to host
    "ssh: Could not resolve hostname",
    "kex_exchange_identification",  # the server hung up before the handshake
    "Network is unreachable",
    "No route to host",
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


@contextmanager
def ssh_access(
    key_env: str, known_hosts_env: str, timeout: float
) -> Iterator[tuple[dict[str, str], list[str]]]:
    """(the child environment that makes git's ssh use this key and trust only these host
    keys, the secrets to scrub from what git prints); the files exist until the block ends."""
    key = read_credentials(key_env).replace("\r\n", "\n").strip() + "\n"
    known = read_credentials(known_hosts_env).replace("\r\n", "\n").strip() + "\n"
    with tempfile.TemporaryDirectory(prefix="airlock-ssh-", dir=SCRATCH) as scratch:
        key_file, hosts_file = Path(scratch) / "id", Path(scratch) / "known_hosts"
        for path, text in ((key_file, key), (hosts_file, known)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(text)
        command = [
            "ssh",
            "-F",
            "/dev/null",
            "-i",
            str(key_file),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "IdentityAgent=none",
            "-o",
            "BatchMode=yes",
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
        env = {"GIT_SSH_COMMAND": shlex.join(command), "GIT_SSH_VARIANT": "ssh"}
        yield env, _key_secrets(key)


def _key_secrets(key: str) -> list[str]:
    """The key's text and each line of its body, to scrub from anything git printed."""
    lines = [line.strip() for line in key.splitlines()]
    return [key, *(line for line in lines if line and not line.startswith("-----"))]


def ssh_complaint(stderr: str) -> tuple[bool, str] | None:
    """(unreachable?, the line) when ssh says nothing was sent — it could not connect, or
    the server's host key or our key was refused — else None."""
    for line in stderr.splitlines():
        text = line.strip().removeprefix("fatal: ")
        if any(sign in text for sign in UNREACHABLE):
            return True, text
        if any(sign in text for sign in REFUSED):
            return False, text
    return None
