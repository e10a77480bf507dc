"""Files in a git repository as a target: the `git` command, run without a shell.

A kind's settings (`GitSettings.from_settings`):

    repository   a local path to a repository (bare or not), or a remote URL (below)
    mirror       a remote repository's local bare mirror (an absolute path; created on use)
    credentials_env  an http(s) remote's credentials variable (user:password or a token)
    ca_bundle_env    an https remote's variable holding the PEM text of the CA bundle to
                 trust instead of the system store (engine/targets/tls.py; never unverified)
    client_cert_env  an https remote's variable holding the PEM text of a client certificate
                 and its unencrypted key, for a server requiring mutual TLS
    ssh_key_env, ssh_known_hosts_env   an ssh remote's variables: the private key's text,
                 and the known_hosts line(s) pinning the server's host key (both required,
                 unless `ssh_agent_env` replaces the key)
    ssh_key_passphrase_env  the variable holding the passphrase of the key (optional)
    ssh_agent_env    instead of ssh_key_env: the variable holding an ssh-agent's socket path
    branch       the branch the documents live on (created by the first create if absent)
    path_prefix  optional folder inside the repository ("config/tenants/")
    author_name, author_email   who the commits are by (default "Airlock")

A resource is one file, `<path_prefix><name>`: `.json` read and written as JSON, `.yaml` /
`.yml` as YAML (`yaml.safe_load` / `safe_dump`: comments and key order are not kept); any
other name is refused. Its version is the file's blob id (content-addressed: writing the same
document back gives the same version).

A write builds the new commit with plumbing only — `hash-object -w`, a temporary index
(GIT_INDEX_FILE) filled by `read-tree <head>`, `update-index --cacheinfo`, `write-tree`,
`commit-tree -p <head>` — and moves the branch by compare-and-swap: `update-ref
refs/heads/<branch> <new> <head>`. When the CAS loses (someone committed meanwhile) the file's
blob at the new head decides: unchanged → the single-file change is rebuilt on the new head
and tried again (a commit elsewhere is not a conflict); changed → stale, with the current
document. After `MAX_REBASES` lost races in a row → locked (back off).

Fencing: the commit records `Airlock-Fence: <n>` as a trailer; a write first reads the fence
of the last commit that touched the file and refuses (fenced) when it is not lower than its
own. The check and the branch move are one unit because the CAS names the head the check
read. Commits made outside Airlock carry no fence (0). Reading that last commit walks the
history of one path (`git log -1 -- <path>`), which costs more on a long history.

A remote repository (`file://`, `http://`, `https://`, `ssh://` or `user@host:path`) is worked
on through a local bare `mirror`: `ls-remote` + `fetch` read the branch, the commit is built
in the mirror the same way, and `push --force-with-lease=<ref>:<head>` moves the branch by
compare-and-swap on the remote (engine/targets/git_remote.py). `credentials_env` (http(s)
only) holds `user:password` or a token, handed to git by a credential helper through the
child's environment; an ssh remote's key and pinned host keys reach git's ssh through
GIT_SSH_COMMAND, host key checking always strict (engine/targets/git_ssh.py). A push with no
answer for our ref is `unknown`: settle by reading.

A non-bare repository whose working tree has the branch checked out is left behind by
`update-ref` (its files look modified): point Airlock at a bare repository or another branch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from engine.targets.base import (
    ABSENT,
    Capabilities,
    Outcome,
    RestoresByVerbs,
    Snapshot,
    TargetConfigError,
    TargetError,
    WriteResult,
    check_env_name,
    child_environment,
    refuse_unknown_settings,
)
from engine.targets.git_remote import (
    LOST,
    MOVED,
    UNKNOWN,
    GitRemote,
    RemoteUnreachable,
    check_remote_url,
)
from engine.targets.git_ssh import is_ssh_url
from engine.targets.tls import tls_setting

MAX_REBASES = 8
ZERO = "0" * 40
_KNOWN = (
    "repository",
    "mirror",
    "credentials_env",
    "ca_bundle_env",
    "client_cert_env",
    "ssh_key_env",
    "ssh_known_hosts_env",
    "ssh_key_passphrase_env",
    "ssh_agent_env",
    "branch",
    "path_prefix",
    "author_name",
    "author_email",
    "timeout",
)
_TLS_SETTINGS = ("ca_bundle_env", "client_cert_env")  # https remotes only (tls.py)
# A conservative branch name (git check-ref-format allows more, we need no more).
_BRANCH = re.compile(r"^(?!.*\.\.)(?!.*//)(?!/)[A-Za-z0-9._/-]{1,200}(?<![./])$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_FORMATS = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}
_TRAILER_VALUE = re.compile(r"[\r\n]+")


class _GitTimeout(TargetError):
    """A git command outlived the kind's timeout and was killed."""


@dataclass(frozen=True)
class GitSettings:
    repository: str
    branch: str
    path_prefix: str = ""
    author_name: str = "Airlock"
    author_email: str = "airlock@localhost"
    timeout: float = 30.0
    mirror: str | None = None  # a remote repository's local bare mirror
    credentials_env: str | None = None  # an http(s) remote's user:password (or token)
    ca_bundle_env: str | None = None  # an https remote's CA bundle to trust (PEM text)
    client_cert_env: str | None = None  # an https remote's client certificate + key (PEM)
    ssh_key_env: str | None = None  # an ssh remote's private key (its text)
    ssh_known_hosts_env: str | None = None  # an ssh remote's pinned host key line(s)
    ssh_key_passphrase_env: str | None = None  # the passphrase of that key
    ssh_agent_env: str | None = None  # instead of the key: an ssh-agent's socket path

    @property
    def is_remote(self) -> bool:
        return "://" in self.repository or is_ssh_url(self.repository)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> GitSettings:
        if not isinstance(settings, Mapping):
            raise TargetConfigError("settings: an object")
        refuse_unknown_settings(settings, _KNOWN)
        repository = settings.get("repository")
        if not isinstance(repository, str) or not repository:
            raise TargetConfigError("repository: the path of a local git repository")
        mirror = settings.get("mirror")
        credentials_env = settings.get("credentials_env")
        ssh_key_env = settings.get("ssh_key_env")
        ssh_known_hosts_env = settings.get("ssh_known_hosts_env")
        passphrase_env = settings.get("ssh_key_passphrase_env")
        agent_env = settings.get("ssh_agent_env")
        ssh_names = (ssh_key_env, ssh_known_hosts_env, passphrase_env, agent_env)
        if "://" in repository or is_ssh_url(repository) or repository.startswith("git@"):
            problem = check_remote_url(repository)
            if problem:
                raise TargetConfigError(problem)
            if not isinstance(mirror, str) or not os.path.isabs(mirror):
                raise TargetConfigError(
                    "mirror: a remote repository needs the absolute path of a local mirror"
                )
            if credentials_env is not None:
                if not repository.startswith(("http://", "https://")):
                    raise TargetConfigError(
                        "credentials_env: only for http(s) remotes "
                        "(an ssh remote names ssh_key_env and ssh_known_hosts_env)"
                    )
                check_env_name(credentials_env)
            https = repository.startswith("https://")
            tls = {
                name: tls_setting(settings, name, https=https, refusal="only for https remotes")
                for name in _TLS_SETTINGS
            }
            if is_ssh_url(repository):
                _check_ssh_names(ssh_key_env, passphrase_env, agent_env)
                check_env_name(ssh_known_hosts_env, "ssh_known_hosts_env")
            elif any(v is not None for v in ssh_names):
                raise TargetConfigError(
                    "ssh_key_env, ssh_known_hosts_env, ssh_key_passphrase_env and "
                    "ssh_agent_env: only for ssh remotes"
                )
        else:
            if not os.path.isabs(repository):
                raise TargetConfigError("repository: an absolute path")
            tls_names = (settings.get(name) for name in _TLS_SETTINGS)
            remote_only = (mirror, credentials_env, *tls_names, *ssh_names)
            if any(v is not None for v in remote_only):
                raise TargetConfigError(
                    "mirror, credentials_env, ca_bundle_env, client_cert_env and ssh_*_env: "
                    "only for a remote repository"
                )
            tls = dict.fromkeys(_TLS_SETTINGS)
        branch = settings.get("branch", "main")
        if not isinstance(branch, str) or not _BRANCH.match(branch) or branch.endswith(".lock"):
            raise TargetConfigError(f"branch: {branch!r} is not a plain branch name")
        prefix = settings.get("path_prefix", "")
        if not isinstance(prefix, str):
            raise TargetConfigError("path_prefix: a folder path like 'config/'")
        if prefix:
            _check_path(prefix.rstrip("/"), "path_prefix")
            prefix = prefix.rstrip("/") + "/"
        name = settings.get("author_name", "Airlock")
        email = settings.get("author_email", "airlock@localhost")
        for value, setting in ((name, "author_name"), (email, "author_email")):
            if not isinstance(value, str) or not value or re.search(r"[<>\r\n\x00]", value):
                raise TargetConfigError(f"{setting}: a plain one-line text")
        timeout = settings.get("timeout", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise TargetConfigError("timeout: a positive number of seconds")
        return cls(
            repository=repository,
            branch=branch,
            path_prefix=prefix,
            author_name=name,
            author_email=email,
            timeout=float(timeout),
            mirror=mirror,
            credentials_env=credentials_env,
            ca_bundle_env=tls["ca_bundle_env"],
            client_cert_env=tls["client_cert_env"],
            ssh_key_env=ssh_key_env,
            ssh_known_hosts_env=ssh_known_hosts_env,
            ssh_key_passphrase_env=passphrase_env,
            ssh_agent_env=agent_env,
        )


def _check_ssh_names(key_env: Any, passphrase_env: Any, agent_env: Any) -> None:
    """Exactly one of a key or an agent; a passphrase only with a key."""
    if key_env is not None and agent_env is not None:
        raise TargetConfigError("ssh_key_env or ssh_agent_env: one of them, not both")
    if agent_env is not None:
        check_env_name(agent_env, "ssh_agent_env")
        if passphrase_env is not None:
            raise TargetConfigError(
                "ssh_key_passphrase_env: only with ssh_key_env (an agent holds its keys open)"
            )
        return
    if key_env is None:
        raise TargetConfigError("ssh_key_env or ssh_agent_env: an ssh remote needs one of them")
    check_env_name(key_env, "ssh_key_env")
    if passphrase_env is not None:
        check_env_name(passphrase_env, "ssh_key_passphrase_env")


def _check_path(path: str, what: str) -> None:
    parts = path.split("/")
    for part in parts:
        if not _SEGMENT.match(part) or part in (".", "..") or part.lower() == ".git":
            raise TargetConfigError(f"{what}: {path!r} is not a plain relative path")


class GitTarget(RestoresByVerbs):
    def __init__(self, settings: GitSettings) -> None:
        self.settings = settings
        # Where the objects and the index work happen: the repository, or a remote's mirror.
        self._local = settings.mirror if settings.mirror else settings.repository
        self._remote = GitRemote(settings, self._git) if settings.is_remote else None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(holds_fence=True, takes_idempotency_key=False)

    # -- plumbing --------------------------------------------------------------------------

    def _git(
        self,
        *args: str,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        pre: Sequence[str] = (),
    ) -> subprocess.CompletedProcess[bytes]:
        full_env = child_environment(drop_prefix="GIT_")
        full_env.update(env or {})
        try:
            return subprocess.run(
                ["git", "-C", self._local, *pre, *args],
                input=stdin,
                capture_output=True,
                env=full_env,
                timeout=self.settings.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise _GitTimeout(f"git {args[0]}: timed out") from None
        except OSError as exc:
            raise TargetError(f"git {args[0]}: {type(exc).__name__}") from None

    def _must(
        self, *args: str, stdin: bytes | None = None, env: Mapping[str, str] | None = None
    ) -> str:
        done = self._git(*args, stdin=stdin, env=env)
        if done.returncode != 0:
            message = done.stderr.decode(errors="replace").strip().splitlines()
            raise TargetError(
                f"git {args[0]} failed: {message[-1] if message else done.returncode}"
            )
        return done.stdout.decode().strip()

    def _head(self) -> str | None:
        if self._remote is not None:
            return self._remote.fetch_head()
        done = self._git(
            "rev-parse", "--verify", "--quiet", f"refs/heads/{self.settings.branch}^{{commit}}"
        )
        if done.returncode == 0:
            return done.stdout.decode().strip()
        # No such branch (yet) — unless the repository itself is missing.
        self._must("rev-parse", "--git-dir")
        return None

    def path_of(self, name: str) -> str:
        """The file of a resource name, or TargetError for a name that cannot be one."""
        if not isinstance(name, str) or PurePosixPath(name).suffix.lower() not in _FORMATS:
            raise TargetError("a git resource is a .json, .yaml or .yml file")
        try:
            _check_path(name, "name")
        except TargetConfigError as exc:
            raise TargetError(str(exc)) from None
        return f"{self.settings.path_prefix}{name}"

    def _entry(self, head: str | None, path: str) -> tuple[str, str] | None:
        """(mode, blob id) of the file at `head`, or None when it is not there."""
        if head is None:
            return None
        listing = self._must("ls-tree", "-z", head, "--", path)
        if not listing:
            return None
        meta, _, found = listing.rstrip("\x00").partition("\t")
        mode, kind, blob = meta.split()
        if kind != "blob" or found != path:
            raise TargetError("the path is not a file in the repository")
        return mode, blob

    def _parse(self, path: str, raw: bytes) -> Any:
        try:
            text = raw.decode()
            if _FORMATS[PurePosixPath(path).suffix.lower()] == "json":
                return json.loads(text)
            document = yaml.safe_load(text)
            json.dumps(document)  # dates and other YAML-only values are not documents
            return document
        except (ValueError, TypeError, yaml.YAMLError):
            raise TargetError(f"{path} is not a valid document") from None

    @staticmethod
    def _render(path: str, document: Any) -> bytes:
        if _FORMATS[PurePosixPath(path).suffix.lower()] == "json":
            return (
                json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            ).encode()
        return yaml.safe_dump(document, sort_keys=True, allow_unicode=True).encode()

    def _snapshot_at(self, head: str | None, path: str) -> Snapshot:
        entry = self._entry(head, path)
        if entry is None:
            return ABSENT
        raw = self._git("cat-file", "blob", entry[1])
        if raw.returncode != 0:
            raise TargetError("git cat-file failed")
        return Snapshot(self._parse(path, raw.stdout), entry[1])

    def _last_fence(self, head: str | None, path: str) -> int:
        if head is None:
            return 0
        value = self._must(
            "log",
            "-1",
            "--format=%(trailers:key=Airlock-Fence,valueonly,separator=%x2C)",
            head,
            "--",
            path,
        )
        try:
            return max((int(v) for v in value.split(",") if v.strip()), default=0)
        except ValueError:
            return 0

    # -- the one write loop ----------------------------------------------------------------

    def _commit(
        self,
        *,
        name: str,
        document: Any,
        expected_version: str | None,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None,
        operation: str,
    ) -> WriteResult:
        """Write (or delete, with document None and operation "delete") the file on the
        branch head if it is still at `expected_version` (None = absent), by ref CAS."""
        try:
            path = self.path_of(name)
            content = None if operation == "delete" else self._render(path, document)
        except TargetError as exc:
            return WriteResult(Outcome.FAILED, detail=str(exc))
        except (TypeError, ValueError, yaml.YAMLError):
            return WriteResult(Outcome.FAILED, detail="the document cannot be written as a file")
        try:
            if self._remote is not None:
                self._remote.ensure_mirror()
            new_blob = (
                None
                if content is None
                else self._must("hash-object", "-w", "--stdin", stdin=content)
            )
            for _ in range(MAX_REBASES):
                head = self._head()
                entry = self._entry(head, path)
                if (entry[1] if entry else None) != expected_version:
                    return WriteResult(Outcome.STALE, current=self._snapshot_at(head, path))
                last_fence = self._last_fence(head, path)
                if last_fence >= fence:
                    return WriteResult(
                        Outcome.FENCED,
                        current=self._snapshot_at(head, path),
                        detail=f"fence {last_fence} >= {fence}",
                    )
                commit = self._build_commit(
                    head=head,
                    path=path,
                    mode=entry[0] if entry else "100644",
                    blob=new_blob,
                    message=self._message(operation, path, fence, idempotency_key, message_context),
                )
                detail = ""
                try:
                    moved = self._move(commit, head)
                except _GitTimeout as exc:
                    moved, detail = UNKNOWN, str(exc)
                if moved == MOVED:
                    return WriteResult(Outcome.APPLIED, version=new_blob)
                if moved == UNKNOWN:
                    # Killed or cut off mid-CAS: the branch may have moved. Settle by reading.
                    return WriteResult(Outcome.UNKNOWN, detail=detail or "no answer to the push")
                # The branch moved under us: look again (rebase if the file is unchanged).
        except RemoteUnreachable as exc:
            return WriteResult(Outcome.NOT_SENT, detail=str(exc))
        except TargetError as exc:
            return WriteResult(Outcome.FAILED, detail=str(exc))
        return WriteResult(Outcome.LOCKED, detail=f"the branch moved {MAX_REBASES} times in a row")

    def _move(self, commit: str, head: str | None) -> str:
        """Move the branch from `head` to `commit` if it is still at `head`."""
        if self._remote is not None:
            return self._remote.push(commit, head)
        ref = f"refs/heads/{self.settings.branch}"
        moved = self._git("update-ref", ref, commit, head or ZERO)
        return MOVED if moved.returncode == 0 else LOST

    def _build_commit(
        self, *, head: str | None, path: str, mode: str, blob: str | None, message: str
    ) -> str:
        with tempfile.TemporaryDirectory(prefix="airlock-git-") as scratch:
            env = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
            if head is None:
                self._must("read-tree", "--empty", env=env)
            else:
                self._must("read-tree", head, env=env)
            if blob is None:
                # Mode 0 removes the entry; unlike --force-remove it needs no work tree.
                self._must(
                    "update-index", "--index-info", stdin=f"0 {ZERO}\t{path}\n".encode(), env=env
                )
            else:
                self._must("update-index", "--add", "--cacheinfo", f"{mode},{blob},{path}", env=env)
            tree = self._must("write-tree", env=env)
        s = self.settings
        people = {
            "GIT_AUTHOR_NAME": s.author_name,
            "GIT_AUTHOR_EMAIL": s.author_email,
            "GIT_COMMITTER_NAME": s.author_name,
            "GIT_COMMITTER_EMAIL": s.author_email,
        }
        parents = ["-p", head] if head else []
        return self._must(
            "commit-tree", tree, *parents, "-F", "-", stdin=message.encode(), env=people
        )

    @staticmethod
    def _message(
        operation: str,
        path: str,
        fence: int,
        idempotency_key: str,
        context: Mapping[str, str] | None,
    ) -> str:
        def clean(value: Any) -> str:
            return _TRAILER_VALUE.sub(" ", str(value)).strip()[:200]

        context = context or {}
        lines = [f"airlock: {operation} {path}", ""]
        for key, label in (
            ("run", "Airlock-Run"),
            ("action", "Airlock-Action"),
            ("approver", "Approved-by"),
        ):
            if context.get(key):
                lines.append(f"{label}: {clean(context[key])}")
        lines += [f"Airlock-Fence: {fence}", f"Airlock-Idempotency-Key: {clean(idempotency_key)}"]
        return "\n".join(lines) + "\n"

    # -- the interface -------------------------------------------------------------------------

    def read(self, name: str) -> Snapshot:
        path = self.path_of(name)
        return self._snapshot_at(self._head(), path)

    def write(
        self,
        name: str,
        document: Any,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        return self._commit(
            name=name,
            document=document,
            expected_version=expected_version,
            fence=fence,
            idempotency_key=idempotency_key,
            message_context=message_context,
            operation="update",
        )

    def create(
        self,
        name: str,
        document: Any,
        *,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        return self._commit(
            name=name,
            document=document,
            expected_version=None,
            fence=fence,
            idempotency_key=idempotency_key,
            message_context=message_context,
            operation="create",
        )

    def delete(
        self,
        name: str,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        result = self._commit(
            name=name,
            document=None,
            expected_version=expected_version,
            fence=fence,
            idempotency_key=idempotency_key,
            message_context=message_context,
            operation="delete",
        )
        return result
