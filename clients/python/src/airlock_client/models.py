"""What the API answers, as small typed records (the full JSON body stays in `raw`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, overload

#: `superseded`: a person approved an edited version instead (`Action.superseded_by`).
FINAL_ACTION_STATUSES = frozenset(
    {"applied", "conflict", "rejected", "failed", "expired", "cancelled", "undone", "superseded"}
)
ENDED_RUN_STATUSES = frozenset({"rejected", "finished", "expired", "revoked"})


class _HasStatus(Protocol):
    @property
    def status(self) -> str: ...


class _StatusIn:
    """A read-only flag of a record: its `status` is one of these."""

    def __init__(self, *statuses: str) -> None:
        self._statuses = frozenset(statuses)

    @overload
    def __get__(self, record: None, owner: type) -> _StatusIn: ...

    @overload
    def __get__(self, record: _HasStatus, owner: type) -> bool: ...

    def __get__(self, record: _HasStatus | None, owner: type) -> _StatusIn | bool:
        return self if record is None else record.status in self._statuses


@dataclass(frozen=True)
class WriteSetEntry:
    """`resource` is `kind/name` or `kind/prefix*`; operations of create/update/delete."""

    resource: str
    operations: tuple[str, ...] = ("update",)
    lease: bool = False

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"resource": self.resource, "operations": list(self.operations)}
        if self.lease:
            body["lease"] = True
        return body


@dataclass(frozen=True)
class Resource:
    """A document as read, with the ETag every later write of it is conditioned on."""

    kind: str
    name: str
    #: Airlock's own store counts (an int); a kind with an external target (a PostgreSQL
    #: table, an HTTP service, a git repository) gives its own opaque token (a str). Compare
    #: it exactly; write with `etag`.
    version: int | str
    etag: str
    document: Any
    owner_group: str
    raw: dict[str, Any] = field(repr=False)
    #: The approved write already queued to replace this version (`Airlock-Queued-Action`):
    #: a write based on it would be refused; wait for that one (`wait_for_supersede`).
    queued_action: str | None = None

    @property
    def identifier(self) -> str:
        return f"{self.kind}/{self.name}"

    @classmethod
    def from_json(
        cls, body: dict[str, Any], etag: str | None, queued_action: str | None = None
    ) -> Resource:
        return cls(
            kind=str(body["kind"]),
            name=str(body["name"]),
            version=body["version"] if isinstance(body["version"], str) else int(body["version"]),
            etag=etag or str(body.get("etag") or f'"{body["version"]}"'),
            document=body.get("document"),
            owner_group=str(body.get("owner_group") or ""),
            raw=body,
            queued_action=queued_action or None,
        )


@dataclass(frozen=True)
class Run:
    id: str
    status: str
    agent: str
    task: str
    write_set: list[dict[str, Any]]
    expires_at: str
    status_reason: str
    etag: str | None
    raw: dict[str, Any] = field(repr=False)
    #: The run token: only in the answer to the request that created the run.
    token: str | None = field(default=None, repr=False)

    active = _StatusIn("active")
    pending = _StatusIn("pending_approval")
    ended = _StatusIn(*ENDED_RUN_STATUSES)

    @classmethod
    def from_json(cls, body: dict[str, Any], etag: str | None = None) -> Run:
        return cls(
            id=str(body["id"]),
            status=str(body["status"]),
            agent=str(body.get("agent") or ""),
            task=str(body.get("task") or ""),
            write_set=list(body.get("write_set") or []),
            expires_at=str(body.get("expires_at") or ""),
            status_reason=str(body.get("status_reason") or ""),
            etag=etag,
            raw=body,
            token=body.get("token"),
        )


@dataclass(frozen=True)
class Action:
    """One proposed write and where it stands (`status`; `final` once it will not move)."""

    id: str
    run: str
    resource: str
    operation: str
    status: str
    etag: str
    observed_etag: str | None
    conflict_class: str
    approval: dict[str, Any] | None
    execution: dict[str, Any] | None
    conflict: dict[str, Any] | None
    error: dict[str, Any] | None
    undo: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False)
    #: True when the server answered a retried write from its idempotency record.
    replayed: bool = False

    final = _StatusIn(*FINAL_ACTION_STATUSES)

    @property
    def superseded_by(self) -> str | None:
        """A `superseded` action: the id of the edited action a person approved instead
        (`wait` follows it)."""
        link = self.raw.get("superseded_by")
        return str(link["id"]) if isinstance(link, dict) and link.get("id") else None

    @property
    def edited(self) -> dict[str, Any] | None:
        """A person edited your proposal before approving it: `by`, `supersedes` (your
        original action's id), `comment` and `diff` (path, old, new, kind)."""
        edit = self.raw.get("edited")
        return edit if isinstance(edit, dict) else None

    @property
    def result_etag(self) -> str | None:
        value = (self.execution or {}).get("result_etag")
        return None if value is None else str(value)

    @property
    def rejection_comment(self) -> str | None:
        """The person's comment when the action was rejected."""
        if self.status != "rejected" or not self.error:
            return None
        comment = self.error.get("comment")
        return None if comment is None else str(comment)

    @property
    def retryable_by_agent(self) -> bool:
        """A conflict the agent itself may settle by re-reading and proposing again."""
        return bool((self.conflict or {}).get("retryable_by_agent"))

    @classmethod
    def from_json(cls, body: dict[str, Any], *, replayed: bool = False) -> Action:
        return cls(
            id=str(body["id"]),
            run=str(body.get("run") or ""),
            resource=str(body.get("resource") or ""),
            operation=str(body.get("operation") or ""),
            status=str(body["status"]),
            etag=str(body.get("etag") or ""),
            observed_etag=body.get("observed_etag"),
            conflict_class=str(body.get("conflict_class") or ""),
            approval=body.get("approval"),
            execution=body.get("execution"),
            conflict=body.get("conflict"),
            error=body.get("error"),
            undo=body.get("undo"),
            raw=body,
            replayed=replayed,
        )


#: A plan that will not move any more. `partially_compensated` is not among them: its
#: blocked compensations are conflicts a person settles, which finishes the plan.
#: `superseded`: a person approved it with a step edited (`Plan.superseded_by`).
FINAL_PLAN_STATUSES = frozenset(
    {"applied", "compensated", "rejected", "expired", "cancelled", "superseded"}
)


@dataclass(frozen=True)
class PlanStep:
    """One step of a plan as the server reports it (`position` counts from 1)."""

    position: int
    resource: str
    operation: str
    status: str
    observed_etag: str | None
    conflict_class: str
    #: The step's action once its turn came (None while it waits).
    action_id: str | None
    applied: dict[str, Any] | None
    compensation: dict[str, Any]
    error: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False)

    @property
    def result_etag(self) -> str | None:
        """The ETag of the version this step produced (None until applied)."""
        version = (self.applied or {}).get("result_version")
        return None if version is None else f'"{version}"'

    @property
    def compensation_status(self) -> str:
        """`none`, `pending`, `compensated`, `conflict`, `resolved` or `failed`."""
        return str(self.compensation.get("status") or "none")

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> PlanStep:
        action = body.get("action") or {}
        return cls(
            position=int(body["position"]),
            resource=str(body.get("resource") or ""),
            operation=str(body.get("operation") or ""),
            status=str(body["status"]),
            observed_etag=body.get("observed_etag"),
            conflict_class=str(body.get("conflict_class") or ""),
            action_id=str(action["id"]) if action.get("id") else None,
            applied=body.get("applied"),
            compensation=dict(body.get("compensation") or {}),
            error=body.get("error"),
            raw=body,
        )


@dataclass(frozen=True)
class Plan:
    """Several writes of one run, approved as one, applied in order and compensated in
    reverse when a later step fails for good. `is_final` once it will not move."""

    id: str
    run: str
    agent: str
    status: str
    reason: str
    error: dict[str, Any] | None
    approval: dict[str, Any] | None
    steps: tuple[PlanStep, ...]
    etag: str | None
    raw: dict[str, Any] = field(repr=False)
    #: True when the server answered a retried proposal from its idempotency record.
    replayed: bool = False

    is_final = _StatusIn(*FINAL_PLAN_STATUSES)
    pending = _StatusIn("pending_approval")
    #: Every step applied.
    applied = _StatusIn("applied")
    #: A step failed for good and every applied step before it was compensated.
    compensated = _StatusIn("compensated")
    #: Some compensations became conflicts that a person decides (`conflicts`).
    partially_compensated = _StatusIn("partially_compensated")

    @property
    def superseded_by(self) -> str | None:
        """A `superseded` plan: the id of the plan a person approved with one step edited
        instead (nothing of this one ran). `wait_for_plan` follows it."""
        link = self.raw.get("superseded_by")
        return str(link["id"]) if isinstance(link, dict) and link.get("id") else None

    @property
    def edited(self) -> dict[str, Any] | None:
        """A plan a person edited before approving: `by`, `supersedes` (the agent's plan),
        `step`, `resource`, `comment` and the `diff` from the agent's step."""
        edit = self.raw.get("edited")
        return dict(edit) if isinstance(edit, dict) else None

    @property
    def failed_step(self) -> PlanStep | None:
        """The step that failed for good (the plan's `error` names it)."""
        position = (self.error or {}).get("step")
        return next((s for s in self.steps if s.position == position), None)

    @property
    def conflicts(self) -> list[str]:
        """Ids of the conflicts that block compensations (a person resolves them)."""
        return [
            str(step.compensation["conflict"])
            for step in self.steps
            if step.compensation.get("conflict")
        ]

    @classmethod
    def from_json(
        cls, body: dict[str, Any], etag: str | None = None, *, replayed: bool = False
    ) -> Plan:
        return cls(
            id=str(body["id"]),
            run=str(body.get("run") or ""),
            agent=str(body.get("agent") or ""),
            status=str(body["status"]),
            reason=str(body.get("reason") or ""),
            error=body.get("error"),
            approval=body.get("approval"),
            steps=tuple(PlanStep.from_json(step) for step in body.get("steps") or []),
            etag=etag,
            raw=body,
            replayed=replayed,
        )
