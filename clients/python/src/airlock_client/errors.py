"""Typed errors: one exception class per problem `code` of the Airlock API.

Every 4xx/5xx answer of the API is `application/problem+json` with `code` and
`retryable`; `problem_error()` turns it into the matching class below, carrying
the problem's fields as attributes (and the whole body as `problem`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, ClassVar


class AirlockError(Exception):
    """Anything this client raises."""


class TransportFailed(AirlockError):
    """The server could not be reached, or the connection broke, and the request
    could not be (or was no longer) safely retried within the retry budget."""


class InvalidIdentifier(AirlockError, ValueError):
    """An id that is not a UUID, or a resource kind or name that could leave its place in
    the URL (empty, `.`, `..`, not `kind/name`). Raised before anything is sent."""


class RunNotApproved(AirlockError):
    """A run did not become active: rejected, expired or revoked, or still
    `pending_approval` when the caller's wait ran out. `run` is its last state."""

    def __init__(self, message: str, run: Any) -> None:
        super().__init__(message)
        self.run = run


class StillContended(AirlockError):
    """`update` lost the race for `resource` `losses` times in a row (other agents'
    writes kept replacing the version it read) and gave up."""

    def __init__(self, resource: str, losses: int) -> None:
        super().__init__(f"{resource}: lost to other writers {losses} times in a row")
        self.resource = resource
        self.losses = losses


#: How a problem field is read into the attribute of the same name, by the attribute's
#: annotation on the class (a field the body lacks reads as the empty value).
_READ_AS: dict[str, Callable[[Any], object]] = {
    "str": lambda value: str(value or ""),
    "str | None": lambda value: None if value is None else str(value),
    "list[dict[str, Any]]": lambda value: list(value or []),
    "dict[str, Any]": lambda value: dict(value) if isinstance(value, dict) else {},
}


class ProblemError(AirlockError):
    """An `application/problem+json` answer. Subclasses are chosen by `code`; the
    problem fields a subclass annotates become its attributes."""

    code: ClassVar[str] = ""
    _fields: ClassVar[dict[str, Callable[[Any], object]]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        own = inspect.get_annotations(cls)
        cls._fields = {**cls._fields, **{name: _READ_AS[kind] for name, kind in own.items()}}

    def __init__(
        self,
        problem: dict[str, Any],
        *,
        status: int,
        retry_after: float | None = None,
        request_id: str | None = None,
    ) -> None:
        self.problem = problem
        self.status = status
        self.problem_code = str(problem.get("code") or "")
        self.title = str(problem.get("title") or "")
        self.detail = str(problem.get("detail") or "")
        self.retryable = bool(problem.get("retryable", False))
        self.retry_after = retry_after
        self.request_id = request_id or problem.get("request_id")
        for name, read in self._fields.items():
            setattr(self, name, read(problem.get(name)))
        super().__init__(f"{status} {self.problem_code}: {self.detail or self.title}")

    @property
    def step(self) -> int | None:
        """The plan step (counted from 1) a refused plan proposal names: the problem's
        `step`, or the first field error under `steps[i]` / `steps.i` (0-based)."""
        named = self.problem.get("step")
        if isinstance(named, int):
            return named
        for error in self.problem.get("errors") or []:
            found = _STEP_FIELD.search(str((error or {}).get("field") or ""))
            if found:
                return int(found.group(1) or found.group(2)) + 1
        return None


_STEP_FIELD = re.compile(r"\bsteps(?:\[(\d+)\]|\.(\d+))")


class BadRequest(ProblemError):
    code = "bad_request"


class MalformedJson(BadRequest):
    code = "malformed_json"


class BadHeader(BadRequest):
    code = "bad_header"


class ValidationError(ProblemError):
    """400 / 422: the request's shape or a value is wrong; `errors` is a list of
    {field, message} (for a plan, `step` is the first step a field names)."""

    code = "validation_error"
    errors: list[dict[str, Any]]


class IdempotencyKeyMissing(ProblemError):
    """400: a write without an Idempotency-Key. This client sends one with every write
    (and reuses it on retries), so this means a request built by hand."""

    code = "idempotency_key_missing"


class IdempotencyKeyInvalid(ProblemError):
    code = "idempotency_key_invalid"


class IdempotencyKeyReused(ProblemError):
    """The key was used before with a different method, path or body."""

    code = "idempotency_key_reused"


class IdempotencyKeyInFlight(ProblemError):
    """The first request with this key is still being processed (retryable)."""

    code = "idempotency_key_in_flight"


class Unauthenticated(ProblemError):
    code = "unauthenticated"


class Forbidden(ProblemError):
    code = "forbidden"


class SelfApproval(Forbidden):
    code = "self_approval"


class OutsideWriteSet(Forbidden):
    """403 `not_in_write_set`: the run's write set does not cover `resource` for
    `operation`. Start a run whose write set names it."""

    code = "not_in_write_set"
    resource: str
    operation: str


class NotFound(ProblemError):
    code = "not_found"


class MethodNotAllowed(ProblemError):
    code = "method_not_allowed"


class NotAcceptable(ProblemError):
    code = "not_acceptable"


class Conflict(ProblemError):
    """A 409 whose code has no class of its own."""

    code = "conflict"


class RunNotActive(Conflict):
    """409: the run is pending approval, rejected, finished, expired or revoked."""

    code = "run_not_active"
    run: str
    run_status: str


class WriteSetConflict(Conflict):
    """409: another active run holds overlapping write authority: `overlaps` lists
    where. Narrow the write set, or wait until that run has finished."""

    code = "write_set_conflict"
    overlaps: list[dict[str, Any]]


class InvalidTransition(Conflict):
    code = "invalid_transition"


class AlreadyDecided(Conflict):
    code = "already_decided"


class ApprovalExpired(Conflict):
    code = "approval_expired"


class UndoWindowExpired(Conflict):
    code = "undo_window_expired"


class UndoRefused(Conflict):
    code = "undo_refused"


class AlreadyUndone(Conflict):
    code = "already_undone"


class StaleFence(Conflict):
    code = "stale_fence"


class LockBusy(Conflict):
    code = "lock_busy"


class LockLost(Conflict):
    code = "lock_lost"


class StaleVersion(ProblemError):
    """412: the version you read is no longer current. Re-read, re-plan on the
    current document, and propose again (never resend the same write)."""

    code = "stale_version"
    resource: str
    expected_etag: str | None
    current_etag: str | None
    conflict_class: str
    resolver: str

    @property
    def queued_action(self) -> str | None:
        """The id of the approved write already queued that will replace the version
        you read (the tag still matched): wait for it, then re-read. None otherwise."""
        queued = self.problem.get("queued_action")
        return str(queued["id"]) if isinstance(queued, dict) and queued.get("id") else None


class PayloadTooLarge(ProblemError):
    code = "payload_too_large"


class UnsupportedMediaType(ProblemError):
    code = "unsupported_media_type"


class Leased(ProblemError):
    """423: another run holds an exclusive lease: `lease` = {run, expires_at}."""

    code = "leased"
    lease: dict[str, Any]


class PreconditionRequired(ProblemError):
    code = "precondition_required"


class IfMatchInvalid(ProblemError):
    """400: a write's If-Match must be the one strong ETag you read (no `*`, no list, no weak
    tag). The client always sends what it read, so this means a hand-built precondition."""

    code = "if_match_invalid"


class RateLimited(ProblemError):
    """429: slow down; `retry_after` seconds (from the Retry-After header)."""

    code = "rate_limited"


class InternalError(ProblemError):
    code = "internal_error"


class NotImplementedOnServer(ProblemError):
    code = "not_implemented"


class KillSwitchEngaged(ProblemError):
    """503: a kill switch covers this write; queued work pauses until release."""

    code = "kill_switch_engaged"


class TransientConflict(ProblemError):
    """503: the transaction lost a race and was rolled back; nothing was written."""

    code = "transient_conflict"


class Unavailable(ProblemError):
    code = "unavailable"


class ClaimHeld(ProblemError):
    """409: another person has claimed this approval or conflict in the console."""

    code = "claim_held"


class TargetUnavailable(ProblemError):
    """502: the kind's external target (a table, an HTTP service, a repository) could not be
    read; ask again later."""

    code = "target_unavailable"


class WeakValidator(ProblemError):
    """502: the kind's target gave a weak or no version for the document; Airlock will not
    write on it (never a blind write)."""

    code = "weak_validator"


def _all_subclasses(cls: type[ProblemError]) -> list[type[ProblemError]]:
    found: list[type[ProblemError]] = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


#: Every problem code this client knows, and the class raised for it.
ERRORS_BY_CODE: dict[str, type[ProblemError]] = {
    cls.code: cls for cls in _all_subclasses(ProblemError) if cls.code
}


def problem_error(
    status: int,
    body: Any,
    *,
    retry_after: float | None = None,
    request_id: str | None = None,
) -> ProblemError:
    """The typed exception for an error answer (an unknown code: ProblemError)."""
    problem: dict[str, Any] = body if isinstance(body, dict) else {"detail": str(body or "")}
    problem.setdefault("status", status)
    cls = ERRORS_BY_CODE.get(str(problem.get("code") or ""), ProblemError)
    return cls(problem, status=status, retry_after=retry_after, request_id=request_id)
