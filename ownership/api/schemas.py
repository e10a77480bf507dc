"""Request and response schemas of the resources, conflicts and catalog API."""

# ninja's Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from ninja import Field, Path, Schema
from pydantic import BeforeValidator, ConfigDict

from console.api_support import TEXT_PATTERN, JsonInt

KIND_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+=,-]{0,254}$"
PREFIX_PATTERN = r"^[A-Za-z0-9._:@+=,-]{0,255}$"
# If-Match on a write: one strong entity tag (RFC 9110 allows more; the contract does not).
STRONG_ETAG_PATTERN = r'^[ \t]*"[!#-~]*"[ \t]*$'
KindPath = Path(..., pattern=KIND_PATTERN)
NamePath = Path(..., pattern=NAME_PATTERN)


class ResourceOut(Schema):
    kind: str
    name: str
    version: int | str = Field(
        ..., description="Airlock's own counter, or an external target's token (text)"
    )
    etag: str
    document: Any
    owner_group: str
    updated_at: datetime


class ResourcePage(Schema):
    items: list[ResourceOut]
    next: str | None


class ConflictClassOut(Schema):
    slug: str
    name: str
    description: str
    approval_mode: Literal["per_run", "per_call"]
    on_conflict: str
    resolver: str
    retryable_by_agent: bool
    quorum: int
    undo_window_seconds: int
    approval_ttl_seconds: int
    escalation_seconds: int
    escalation_group: str
    forbid_agent_owner_approval: bool
    grants_allowed: bool
    updated_at: datetime


class ConflictClassList(Schema):
    items: list[ConflictClassOut]


_RFC3339 = re.compile(
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)


def _timestamp(value: Any) -> Any:
    """A read-only `updated_at` sent back as GET returned it: an RFC 3339 date-time."""
    if not isinstance(value, str) or not _RFC3339.match(value):
        raise ValueError("must be an RFC 3339 date-time string")
    # fromisoformat knows no lowercase separators and no leap second.
    normal = value.upper().replace(":60", ":59", 1) if value[17:19] == "60" else value.upper()
    try:
        datetime.fromisoformat(normal)
    except ValueError as exc:
        raise ValueError("must be an RFC 3339 date-time string") from exc
    return value


ReadOnlyTimestamp = Annotated[str, BeforeValidator(_timestamp)]
_READ_ONLY = "Read-only, accepted so that GET -> edit -> PUT works: "


class _CatalogRowIn(Schema):
    """A catalog row as PUT takes it: strict, and the server's stamp accepted back."""

    model_config = ConfigDict(extra="forbid", strict=True)

    updated_at: ReadOnlyTimestamp | None = Field(
        None,
        description=_READ_ONLY + "stamped by the server; any date-time is ignored.",
        json_schema_extra={"format": "date-time"},
    )


class ConflictClassIn(_CatalogRowIn):
    slug: str | None = Field(
        None, pattern=KIND_PATTERN, description=_READ_ONLY + "must equal the path's slug."
    )
    retryable_by_agent: bool | None = Field(
        None,
        description=_READ_ONLY + "derived (`resolver` is `agent`); 422 when it contradicts.",
    )

    name: str = Field(..., min_length=1, max_length=200, pattern=TEXT_PATTERN)
    description: str = Field("", max_length=5000, pattern=TEXT_PATTERN)
    approval_mode: Literal["per_run", "per_call"]
    on_conflict: Literal[
        "retry", "recompute", "present_candidates", "request_review", "stop_unless_lease"
    ]
    resolver: str = Field(..., pattern=r"^(agent|owner|group:[A-Za-z0-9._-]{1,140})$")
    quorum: JsonInt = Field(1, ge=1, le=20)
    undo_window_seconds: JsonInt = Field(600, ge=0, le=2_592_000)
    approval_ttl_seconds: JsonInt = Field(172_800, ge=60, le=2_592_000)
    escalation_seconds: JsonInt = Field(0, ge=0, le=2_592_000)
    escalation_group: str = Field("", pattern=r"^[A-Za-z0-9._-]{0,150}$")
    forbid_agent_owner_approval: bool = True
    grants_allowed: bool = Field(
        True,
        description="Whether approvers may give standing grants (`grant` on a decision) for "
        "writes of this class. Never applies above a quorum of one.",
    )


class KindClasses(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    create: str = Field(..., pattern=KIND_PATTERN)
    update: str = Field(..., pattern=KIND_PATTERN)
    delete: str = Field(..., pattern=KIND_PATTERN)


class ResourceKindIn(_CatalogRowIn):
    kind: str | None = Field(
        None, pattern=KIND_PATTERN, description=_READ_ONLY + "must equal the path's kind."
    )

    classes: KindClasses
    owner_group: str = Field(..., pattern=r"^[A-Za-z0-9._-]{1,150}$")
    undo_window_seconds: JsonInt | None = Field(None, ge=0, le=2_592_000)
    description: str = Field("", max_length=5000, pattern=TEXT_PATTERN)
    target: Literal["managed", "http", "postgres", "git"] = "managed"
    target_url: str = Field("", max_length=200, pattern=TEXT_PATTERN)
    target_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="The target's settings (docs/targets.md): table and columns, repository "
        "and branch, auth scheme… Never a credential: `credentials_env` (an https target's "
        "`ca_bundle_env` and `client_cert_env`, a git ssh remote's `ssh_key_env`, "
        "`ssh_known_hosts_env`, `ssh_key_passphrase_env`, `ssh_agent_env`) names the "
        "environment variable the worker reads it from. An http "
        "kind with no settings speaks Airlock's own dialect (honours our Idempotency-Key "
        "and Fencing-Token).",
    )
    capabilities: dict[str, bool] | None = Field(
        None, description=_READ_ONLY + "derived from the target; ignored."
    )
    probe_resource: str | None = Field(
        None,
        max_length=255,
        description="Write-only: a document read once when the kind is saved; a target that "
        "answers with a weak or missing validator is refused (422).",
    )


class ResourceKindOut(Schema):
    kind: str
    description: str
    classes: dict[str, str]
    owner_group: str
    undo_window_seconds: int | None
    target: str
    target_url: str
    target_settings: dict[str, Any]
    capabilities: dict[str, bool]
    updated_at: datetime


class ResourceKindList(Schema):
    items: list[ResourceKindOut]


class FieldDiff(Schema):
    model_config = ConfigDict(extra="allow")

    path: str
    base: Any = None
    current: Any = None
    proposed: Any = None
    change: Literal["agent_only", "other_only", "both"]


class DocumentAt(Schema):
    etag: str | None
    document: Any = None


class ProposedDocument(Schema):
    document: Any = None


class ConflictOut(Schema):
    id: uuid.UUID
    action: uuid.UUID
    resource: str
    conflict_class: str
    resolver: str
    resolver_group: str
    origin: Literal["write", "undo"]
    status: Literal["open", "resolved"]
    base: DocumentAt
    current: DocumentAt
    proposed: ProposedDocument
    fields: list[FieldDiff]
    resolution: dict[str, Any] | None
    created_at: datetime


class ConflictPage(Schema):
    items: list[ConflictOut]
    next: str | None


class ResolutionIn(Schema):
    model_config = ConfigDict(extra="forbid", strict=True)

    choice: Literal["keep_current", "take_proposed", "merge"]
    # Keys are JSON pointers of the conflict's fields (checked by the service).
    fields: dict[str, Literal["current", "proposed"]] = Field(default_factory=dict)
    comment: str = Field("", max_length=2000, pattern=TEXT_PATTERN)
