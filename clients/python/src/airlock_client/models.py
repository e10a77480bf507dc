"""What the API answers, as small typed records (the full JSON body stays in `raw`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINAL_ACTION_STATUSES = frozenset(
    {"applied", "conflict", "rejected", "failed", "expired", "cancelled", "undone"}
)
ENDED_RUN_STATUSES = frozenset({"rejected", "finished", "expired", "revoked"})


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
    version: int
    etag: str
    document: Any
    owner_group: str
    raw: dict[str, Any] = field(repr=False)

    @property
    def identifier(self) -> str:
        return f"{self.kind}/{self.name}"

    @classmethod
    def from_json(cls, body: dict[str, Any], etag: str | None) -> Resource:
        return cls(
            kind=str(body["kind"]),
            name=str(body["name"]),
            version=int(body["version"]),
            etag=etag or str(body.get("etag") or f'"{body["version"]}"'),
            document=body.get("document"),
            owner_group=str(body.get("owner_group") or ""),
            raw=body,
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

    @property
    def active(self) -> bool:
        return self.status == "active"

    @property
    def pending(self) -> bool:
        return self.status == "pending_approval"

    @property
    def ended(self) -> bool:
        return self.status in ENDED_RUN_STATUSES

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

    @property
    def final(self) -> bool:
        return self.status in FINAL_ACTION_STATUSES

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
