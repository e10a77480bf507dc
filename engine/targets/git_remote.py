"""A remote git repository for the git target: a local bare mirror, `fetch` to read the
branch, `push --force-with-lease` to move it by compare-and-swap on the remote.

The lease names the head the write was built on, and the remote's receive-pack updates the
ref only if it still holds that head (its ref transaction checks the old value), so a push
that loses the race is refused and the write looks again — exactly as `update-ref` locally.

Credentials (`credentials_env`, for http(s) remotes): the variable holds `user:password` or
a bare token. They reach git through a credential helper that reads them from the child
process's environment — never from the URL, the command line (visible in `ps`), the mirror's
config or a file — and every message is scrubbed of them.

https remotes: every fetch and push runs with `http.<url>.sslVerify=true`, and with
`ca_bundle_env` trusts only that CA bundle (engine/targets/tls.py). A certificate that does
not verify means nothing was sent: `RemoteUnreachable`, at the fetch and at the push. With
`client_cert_env` git's curl presents that client certificate (`http.<url>.sslCert` /
`sslKey`, a private file while git runs). A server refusing it ends the TLS session at git's
first request — the refs, a GET ("unable to access"): nothing was pushed, `RemoteUnreachable`;
met later, while the pack is posted, the push stays `unknown`.

ssh remotes (`ssh://`, `user@host:path`; engine/targets/git_ssh.py): `ssh_key_env` (with
`ssh_key_passphrase_env`) or `ssh_agent_env`, and `ssh_known_hosts_env`, reach git's ssh
through `GIT_SSH_COMMAND` for each fetch and push, host key checking always strict. ssh saying
nothing was sent (no connection or a passphrase that does not open the key → not sent; an
unknown host key or a refused key → failed) decides a push with no answer for our ref.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Protocol

from engine.targets import git_ssh
from engine.targets.base import TargetError, child_environment, read_credentials, scrub
from engine.targets.git_ssh import UNREACHABLE as SSH_UNREACHABLE
from engine.targets.git_ssh import check_ssh_url, is_ssh_url, ssh_access, ssh_complaint
from engine.targets.tls import (
    ca_bundle,
    curl_certificate_complaint,
    curl_session_ended,
    git_tls_config,
    refused_at_the_refs,
    refused_certificate,
)

# Git runs a `!`-helper with the shell; the values come from the environment git inherits.
_HELPER = (
    'credential.helper=!f() { test "$1" = get || exit 0; '
    'echo "username=$AIRLOCK_GIT_USERNAME"; echo "password=$AIRLOCK_GIT_PASSWORD"; }; f'
)
MOVED, LOST, UNKNOWN = "moved", "lost", "unknown"
# What git (curl, ssh) says when the remote could not be reached at all: nothing was sent.
_UNREACHABLE = (
    "Failed to connect",
    "Could not resolve host",
    "Connection refused",
    "Connection timed out",
    "Operation timed out",
    *SSH_UNREACHABLE,
)
_NETWORK = frozenset({"fetch", "push", "ls-remote"})


class RemoteUnreachable(TargetError):
    """The remote could not be reached: nothing was sent, retry later."""


class RemoteSettings(Protocol):
    @property
    def repository(self) -> str: ...
    @property
    def branch(self) -> str: ...
    @property
    def mirror(self) -> str | None: ...
    @property
    def credentials_env(self) -> str | None: ...
    @property
    def ca_bundle_env(self) -> str | None: ...
    @property
    def client_cert_env(self) -> str | None: ...
    @property
    def ssh_key_env(self) -> str | None: ...
    @property
    def ssh_known_hosts_env(self) -> str | None: ...
    @property
    def ssh_key_passphrase_env(self) -> str | None: ...
    @property
    def ssh_agent_env(self) -> str | None: ...
    @property
    def timeout(self) -> float: ...


Runner = Callable[..., subprocess.CompletedProcess[bytes]]
# (config args, child environment, secrets to scrub, what adds the reason to git's stderr)
_Access = tuple[list[str], dict[str, str], list[str], Callable[[str], str]]


def _as_is(stderr: str) -> str:
    return stderr


class GitRemote:
    def __init__(self, settings: RemoteSettings, run: Runner) -> None:
        self.settings = settings
        self._run = run  # GitTarget._git: `git -C <mirror> <pre…> <args…>` with an env

    def _credentials(self) -> tuple[list[str], dict[str, str], list[str]]:
        """(config args, child environment, secrets to scrub)."""
        env = {"GIT_TERMINAL_PROMPT": "0"}
        if self.settings.credentials_env is None:
            return ["-c", "credential.helper="], env, []
        secret = read_credentials(self.settings.credentials_env)
        user, sep, password = secret.partition(":")
        if not sep:
            user, password = "x-access-token", secret
        env |= {"AIRLOCK_GIT_USERNAME": user, "AIRLOCK_GIT_PASSWORD": password}
        return ["-c", "credential.helper=", "-c", _HELPER], env, [secret, password]

    @contextmanager
    def _access(self, command: str) -> Iterator[_Access]:
        """(config args, child environment, secrets, what explains a failure) for one git
        command; an ssh remote's key files and an https remote's CA bundle and client
        certificate exist only while a fetch or push runs. A variable this worker does not
        have (or an agent socket that is not there, a client certificate that does not load)
        means nothing can be sent: RemoteUnreachable."""
        s = self.settings
        https = command in _NETWORK and s.repository.startswith("https://")
        try:
            pre, env, secrets = self._credentials()
            pem = ca_bundle(s.ca_bundle_env) if https and s.ca_bundle_env else None
        except TargetError as exc:
            raise RemoteUnreachable(str(exc)) from None
        if https:
            with ExitStack() as stack:
                try:
                    tls_env = stack.enter_context(
                        git_tls_config(
                            s.repository, pem, git_ssh.SCRATCH, client_cert_env=s.client_cert_env
                        )
                    )
                except TargetError as exc:
                    raise RemoteUnreachable(str(exc)) from None
                yield pre, env | tls_env, secrets, _as_is
            return
        if command not in _NETWORK or not is_ssh_url(s.repository):
            yield pre, env, secrets, _as_is
            return
        with ExitStack() as stack:
            try:
                if s.ssh_known_hosts_env is None:
                    raise TargetError("an ssh remote needs ssh_known_hosts_env")
                ssh = stack.enter_context(
                    ssh_access(
                        key_env=s.ssh_key_env,
                        known_hosts_env=s.ssh_known_hosts_env,
                        timeout=s.timeout,
                        passphrase_env=s.ssh_key_passphrase_env,
                        agent_env=s.ssh_agent_env,
                    )
                )
            except TargetError as exc:
                raise RemoteUnreachable(str(exc)) from None
            yield pre, env | ssh.env, secrets + ssh.secrets, ssh.explain

    def _git(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        with self._access(args[0]) as (pre, env, secrets, explain):
            done = self._run(*args, pre=pre, env=env)
            if done.returncode != 0:  # while the key file is still there to check
                done.stderr = explain(done.stderr.decode(errors="replace")).encode()
        if secrets:  # nothing of the secret leaves in what git printed
            done.stdout = scrub(done.stdout.decode(errors="replace"), secrets).encode()
            done.stderr = scrub(done.stderr.decode(errors="replace"), secrets).encode()
        return done

    def ensure_mirror(self) -> None:
        """Create the bare mirror once. It is built aside and renamed into place, so
        workers racing to create it never see half a repository; the remote's URL is
        passed to each fetch and push, so the mirror has no config to race on."""
        mirror = Path(self.settings.mirror or "")
        if (mirror / "HEAD").exists():
            return
        mirror.parent.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(prefix=".airlock-mirror-", dir=mirror.parent))
        try:
            init = subprocess.run(
                ["git", "init", "--quiet", "--bare", str(aside)],
                capture_output=True,
                env=child_environment(drop_prefix="GIT_"),
                timeout=60,
                check=False,
            )
            if init.returncode != 0:
                raise TargetError("git init of the mirror failed")
            try:
                aside.rename(mirror)
            except OSError:
                if not (mirror / "HEAD").exists():  # not another worker's mirror: real
                    raise TargetError("cannot create the mirror") from None
        finally:
            shutil.rmtree(aside, ignore_errors=True)

    def _must(self, *args: str) -> str:
        done = self._git(*args)
        if done.returncode != 0:
            lines = done.stderr.decode(errors="replace").strip().splitlines()
            raise TargetError(f"git {args[0]} failed: {lines[-1] if lines else done.returncode}")
        return done.stdout.decode().strip()

    def fetch_head(self) -> str | None:
        """The remote branch's head (its objects now in the mirror), or None if absent.

        Each read fetches into a ref of its own (dropped afterwards): workers sharing the
        mirror never race on one tracking ref, and nothing here is trusted as the remote's
        state for longer than this call — the lease decides whether a write lands."""
        self.ensure_mirror()
        mine = f"refs/airlock/fetch/{uuid.uuid4().hex}"
        branch = self.settings.branch
        done = self._git(
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-write-fetch-head",
            self.settings.repository,
            f"+refs/heads/{branch}:{mine}",
        )
        if done.returncode != 0:
            message = done.stderr.decode(errors="replace")
            if "couldn't find remote ref" in message:
                return None
            lines = message.strip().splitlines()
            refused = self._tls_refusal(message)
            if refused is not None:
                raise RemoteUnreachable(f"git fetch failed: {refused}")
            said = ssh_complaint(message)
            reason = said[1] if said else lines[-1] if lines else done.returncode
            text = f"git fetch failed: {reason}"
            if any(sign in message for sign in _UNREACHABLE):
                raise RemoteUnreachable(text)
            raise TargetError(text)
        try:
            return self._must("rev-parse", f"{mine}^{{commit}}")
        finally:
            self._git("update-ref", "-d", mine)

    def _tls_refusal(self, stderr: str) -> str | None:
        """Why git's curl sent nothing, when TLS stopped it on an https remote: the server's
        certificate did not verify, or the server ended the session at git's first request
        (how it refuses our client certificate)."""
        s = self.settings
        if not s.repository.startswith("https://"):
            return None
        unverified = curl_certificate_complaint(stderr)
        if unverified is not None:
            return refused_certificate(unverified, s.ca_bundle_env)
        ended = curl_session_ended(stderr)
        return None if ended is None else refused_at_the_refs(ended, s.client_cert_env)

    def push(self, commit: str, head: str | None) -> str:
        """MOVED, LOST (the remote refused: it no longer holds `head`) or UNKNOWN."""
        ref = f"refs/heads/{self.settings.branch}"
        done = self._git(
            "push",
            "--porcelain",
            f"--force-with-lease={ref}:{head or ''}",
            self.settings.repository,
            f"{commit}:{ref}",
        )
        result = classify_push(done.stdout.decode(errors="replace"), done.returncode, ref)
        refused = self._tls_refusal(done.stderr.decode(errors="replace"))
        if result == UNKNOWN and refused is not None:
            # Stopped at the handshake, or at the refs' GET before any pack: nothing was
            # sent, not an unknown outcome.
            raise RemoteUnreachable(f"git push failed: {refused}")
        if result == UNKNOWN and is_ssh_url(self.settings.repository):
            # ssh never got to send anything: say so rather than settle by reading.
            said = ssh_complaint(done.stderr.decode(errors="replace"))
            if said is not None:
                unreachable, line = said
                raise (RemoteUnreachable if unreachable else TargetError)(
                    f"git push failed: {line}"
                )
        return result


def classify_push(porcelain: str, returncode: int, ref: str) -> str:
    """A `git push --porcelain` result for one ref: its flag says what the remote did."""
    for line in porcelain.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[1].endswith(f":{ref}"):
            flag, summary = parts[0], parts[2]
            if flag in (" ", "+", "*", "=") and returncode == 0:
                return MOVED
            if flag == "!" and ("rejected" in summary or "stale info" in summary):
                return LOST
    # No answer for our ref (the connection broke, the remote hung up): it may have moved.
    return UNKNOWN


def check_remote_url(url: str) -> str:
    """The remote URL, or a message saying why it cannot be one (no credentials in it)."""
    if url.startswith(("file://", "http://", "https://")):
        rest = url.split("://", 1)[1]
        host = rest.split("/", 1)[0]
        if "@" in host:
            return "repository: no user or password in the URL — name credentials_env instead"
        return ""
    if is_ssh_url(url):
        return check_ssh_url(url)
    return (
        "repository: a local absolute path, a file://, http://, https:// or ssh:// URL, "
        "or user@host:path"
    )
