"""The one interface every target adapter implements, its outcomes, and the rules shared by
all of them: strong validators only, credentials scrubbed from every message, and settling an
unknown outcome by reading the target (issue 39 §2).

A version is the token the target gives a document (a PostgreSQL counter or `xmin`, an ETag's
opaque value, a git blob id): a string, compared exactly, never parsed. `None` means absent.

Writes never raise for what the target answered or for a transport failure: they return a
`WriteResult` whose `outcome` the caller routes (applied → record it; stale → a conflict
with `current`; not_sent → retry; unknown → settle by reading; locked → back off; fenced → a
newer holder wrote, take a new fence; failed → fail the action). Reads raise `TargetError`
when the target cannot be read (there is nothing to record, the caller retries later) and
`WeakValidator` when it hands out a version that cannot guard a write.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class TargetError(Exception):
    """The target could not be read or refused to be governed. Its text is scrubbed of
    credentials before it is built (see `scrub`), and it never chains the original error
    (whose text may carry a connection string)."""


class TargetConfigError(ValueError):
    """A kind's target settings are invalid: the message says which setting and why."""


class WeakValidator(TargetError):
    """The target gave a weak (`W/`) or no version: a write conditioned on it could overwrite
    someone else's change, so it is refused — never a blind write."""


class Outcome(StrEnum):
    APPLIED = "applied"  # the target took the write; `version` is the new version
    STALE = "stale"  # the version moved (or the document is missing / exists): `current`
    FENCED = "fenced"  # the version matched but a newer fence already wrote
    NOT_SENT = "not_sent"  # nothing reached the target: safe to retry
    UNKNOWN = "unknown"  # sent, no answer: settle by reading before anything else
    LOCKED = "locked"  # the target is busy (a lock, 423/429/503): retry after a backoff
    FAILED = "failed"  # the target refused for good (bad document, missing table, 4xx)


@dataclass(frozen=True)
class Snapshot:
    """A document and its version as the target holds it; `version is None` = absent."""

    document: Any
    version: str | None

    @property
    def exists(self) -> bool:
        return self.version is not None


ABSENT = Snapshot(None, None)


@dataclass(frozen=True)
class Held:
    """Where a target that keeps the fence itself and keeps counting while a document is
    absent (Airlock's store: a tombstone keeps its counter) holds a name after a miss: the
    caller reports the refusal from it without reading the target again."""

    version: str  # the target's version of the name, absent or not
    absent: bool
    fence: int  # the newest fence that wrote it


@dataclass(frozen=True)
class WriteResult:
    outcome: Outcome
    version: str | None = None  # APPLIED: the version the write produced (None after a delete)
    current: Snapshot | None = None  # STALE / FENCED: what the target holds now, when read
    detail: str = ""  # short, scrubbed: what the target said
    retry_after: float | None = None  # LOCKED: seconds the target asked for, if it did
    held: Held | None = None  # STALE / FENCED, from a target that can say (see `Held`)
    # By an adapter in the caller's transaction: the caller's record (row) it wrote, or on
    # a miss the one it found.
    record_id: int | None = None

    @property
    def applied(self) -> bool:
        return self.outcome is Outcome.APPLIED


@dataclass(frozen=True)
class Capabilities:
    holds_fence: bool  # the target itself refuses a write whose fence is not the newest
    takes_idempotency_key: bool  # a replay with the same key returns the first result
    # The adapter writes on the caller's database connection, inside its transaction: its
    # write commits or rolls back with Airlock's records, so it offers `InTransactionTarget`
    # (records carried by the write, several writes at once) and the executor runs it under
    # the write barrier; any other adapter is one call to a system of its own.
    in_caller_transaction: bool = False


@runtime_checkable
class TargetAdapter(Protocol):
    """Read a document and its version; write, create or delete conditionally on a version.

    `fence` is the writer's fencing token (a newer lock holder has a larger one) and
    `idempotency_key` is the same for every attempt of one action; an adapter passes them on
    only where `capabilities` says the target uses them. `message_context` (run, action,
    approver) is recorded where the target has a place for it (a git commit message)."""

    @property
    def capabilities(self) -> Capabilities: ...

    def read(self, name: str) -> Snapshot: ...

    def write(
        self,
        name: str,
        document: Any,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult: ...

    def create(
        self,
        name: str,
        document: Any,
        *,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult: ...

    def delete(
        self,
        name: str,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult: ...

    def restore(
        self,
        name: str,
        document: Any,
        *,
        deleted: bool,
        on_version: str | None,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        """Put back the state a write replaced (an undo, a plan's compensation): `document`,
        or absence when `deleted`, only while the target is still at `on_version` — the
        version that write produced (None: it left the name absent). Most adapters restore
        with their own verbs (`RestoresByVerbs`); a store that keeps counting while a
        document is absent restores a tombstone at its counter in one write."""
        ...


class RestoresByVerbs:
    """`restore` by the interface's three verbs, for an adapter whose target does not keep a
    document's counter while it is absent (every one but Airlock's own store): absence is a
    delete on `on_version`, a document over absence a create, a document over a document a
    write on `on_version`. Inherited by the adapters; one body, not one copy each."""

    def restore(
        self,
        name: str,
        document: Any,
        *,
        deleted: bool,
        on_version: str | None,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        adapter: TargetAdapter = self  # type: ignore[assignment]  # mixed into an adapter
        key, context = idempotency_key, message_context
        if deleted:
            if on_version is None:  # the name is absent and was to be: nothing is conditional
                return WriteResult(Outcome.FAILED, detail="nothing to restore: already absent")
            return adapter.delete(
                name,
                expected_version=on_version,
                fence=fence,
                idempotency_key=key,
                message_context=context,
            )
        if on_version is None:
            return adapter.create(
                name, document, fence=fence, idempotency_key=key, message_context=context
            )
        return adapter.write(
            name,
            document,
            expected_version=on_version,
            fence=fence,
            idempotency_key=key,
            message_context=context,
        )


# -- what an adapter in the caller's transaction adds ----------------------------------------


@dataclass(frozen=True)
class Carried:
    """The caller's records, written by the same statement as the write and only if it lands
    (`Capabilities.in_caller_transaction`). Each of `statements` is a data-modifying
    statement usable as a common table expression; it may read the written row from
    `written` (columns `id, version, document, deleted`). `then` (optional) is one more
    statement sent with the write in the same round trip, after it; its first row comes
    back in `CarriedResult.then_row`."""

    statements: Sequence[tuple[str, Sequence[Any]]]
    then: tuple[str, Sequence[Any]] | None = None


@dataclass(frozen=True)
class CarriedResult:
    result: WriteResult
    then_row: Any = None


@dataclass(frozen=True)
class ManyWrite:
    """One write of a `write_many`: the document (or a tombstone's, when `deleted`) on
    `expected_version` of the caller's record `record_id` (the row it locked)."""

    record_id: int
    expected_version: str
    document: Any
    deleted: bool


@runtime_checkable
class InTransactionTarget(TargetAdapter, Protocol):
    """An adapter whose capabilities say `in_caller_transaction`: a store in Airlock's own
    database, addressed — besides by name — by the caller's record of each document (the
    row the caller locked), so that its writes join the caller's statements."""

    def write_carrying(
        self,
        record_id: int,
        document: Any,
        *,
        expected_version: str,
        deleted: bool,
        fence: int,
        carried: Carried,
    ) -> CarriedResult:
        """An update (or a delete, leaving a tombstone with `document`) of one record in ONE
        round trip with the caller's records. A miss writes nothing, carried or not, and is
        read back: STALE or FENCED with `held`."""
        ...

    def write_many(self, writes: Sequence[ManyWrite], *, fence: int) -> dict[int, WriteResult]:
        """Several updates and deletes in one statement, each landing only where its record
        is still at its version and has seen no fence as new: the records that landed map
        to APPLIED; the others, read back together, to STALE or FENCED with `held`."""
        ...


# -- settling an unknown outcome by reading ------------------------------------------------


@dataclass(frozen=True)
class Applied:
    """The target holds what we wrote under a new version: our write took effect, once."""

    version: str | None


@dataclass(frozen=True)
class NotApplied:
    """The target still holds the version we wrote on: our write did not happen; retry it."""

    current: Snapshot


@dataclass(frozen=True)
class Conflict:
    """Someone else changed it: neither ours nor the version we saw. Route by class."""

    current: Snapshot


Settlement = Applied | NotApplied | Conflict


def settle_by_reading(
    adapter: TargetAdapter,
    name: str,
    *,
    written_document: Any,
    observed_version: str | None,
    deleted: bool = False,
) -> Settlement:
    """Decide what an attempt with an unknown outcome did, from the target alone.

    - still at `observed_version` (absent, for a create) → `NotApplied`: retry the write;
    - holds `written_document` under another version (absent, for a delete) → `Applied`;
    - anything else → `Conflict`: a second blind attempt could overwrite someone's change.

    `observed_version` is the version the write was conditioned on (None for a create).
    A target read failure raises (`TargetError`): nothing is settled, ask again later.
    Limits, said plainly: a delete followed by someone else's delete, or someone else writing
    exactly our document, reads as ours — indistinguishable from the target's side.
    """
    current = adapter.read(name)
    if current.version == observed_version:
        return NotApplied(current)
    if deleted:
        return Applied(None) if not current.exists else Conflict(current)
    if current.exists and current.document == written_document:
        return Applied(current.version)
    return Conflict(current)


# -- validators ------------------------------------------------------------------------------

# RFC 9110 §8.8.3: entity-tag = [ "W/" ] DQUOTE *etagc DQUOTE, etagc = %x21 / %x23-7E / obs-text
_STRONG_ETAG = re.compile(r'^"([\x21\x23-\x7e\x80-\xff]*)"$')


def strong_version(etag: str | None) -> str:
    """The opaque token of a strong ETag (its quotes removed). Refuses a weak tag (`W/`),
    a missing one and a malformed one: none of them can guard a conditional write."""
    if etag is None or not etag.strip():
        raise WeakValidator("the target sent no ETag: it cannot be governed (no validator)")
    tag = etag.strip()
    if tag.startswith("W/"):
        raise WeakValidator("the target sent a weak ETag (W/): refused, never a blind write")
    match = _STRONG_ETAG.match(tag)
    if match is None or not match.group(1):
        raise WeakValidator("the target sent a malformed ETag: refused")
    return match.group(1)


def quoted(version: str) -> str:
    """An opaque version as the ETag an If-Match carries."""
    if not _STRONG_ETAG.match(f'"{version}"'):
        raise TargetError("a version that cannot be sent as an ETag")
    return f'"{version}"'


# -- settings helpers shared by the adapters --------------------------------------------------

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def check_env_name(value: Any, setting: str = "credentials_env") -> str:
    if not isinstance(value, str) or not _ENV_NAME.match(value):
        raise TargetConfigError(
            f"{setting}: the name of an environment variable (letters, digits, _), "
            "not a value — credentials are never stored"
        )
    return value


def read_credentials(env_name: str) -> str:
    """The credential, read at call time and never kept on the adapter."""
    value = os.environ.get(env_name)
    if not value:
        raise TargetError(f"the environment variable {env_name} is not set on this worker")
    return value


# Where secrets live while a command or a handshake needs them as files (an ssh key, a TLS
# client key, the files beside them): memory when we can. Only a fresh mkdtemp directory
# (0700) is made in it, never a guessable name.
_SHM = "/dev/shm"  # noqa: S108
SCRATCH: str | None = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else None


def write_private_file(path: Path, text: str) -> Path:
    """`text` in a new file only its owner can read (0600; refused if `path` exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def child_environment(*, drop_prefix: str) -> dict[str, str]:
    """This process's environment for a child process (the `git` command), without the
    variables that start with `drop_prefix` (a stray GIT_DIR must not redirect a write)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(drop_prefix)}


def refuse_unknown_settings(settings: Mapping[str, Any], known: Iterable[str]) -> None:
    extra = sorted(set(settings) - set(known))
    if extra:
        raise TargetConfigError(f"unknown setting(s): {', '.join(extra)}")


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret (and its pieces worth hiding) replaced by `***`."""
    for secret in sorted({s for s in secrets if s and len(s) >= 3}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text
