"""A kind's target (issue 39): the adapter that reaches it, and the mirror row Airlock keeps
of each resource it governs there.

A kind whose documents live elsewhere (`http`, `postgres`, `git`) is reached only through
`engine.targets`' one interface; this module turns a ResourceKind into that adapter and
records what the target answered. The mirror row (`Resource` with `external_version`) is
what approval cards, conflict pages and the audit trail show: it is refreshed from every
read and every write, and each new token gets a history row (`ResourceVersion`) so a
conflict's base document can be found by the token the agent observed.
"""

from __future__ import annotations

import copy
from typing import Any

from django.db import IntegrityError, transaction

from engine.core.errors import DomainError

# The kind -> adapter rules live in the core (the barrier and undo use them); re-exported
# here for the services and pages.
from engine.core.kind_targets import (
    ADAPTER_OF_TARGET,
    HTTP_DIALECT_DEFAULTS,
    adapter_for_kind,
    adapter_for_settings,
    adapter_settings,
    in_caller_transaction,
    is_external,
)
from engine.core.row_locks import mirror_locked
from engine.targets.base import (
    Snapshot,
    TargetConfigError,
    TargetError,
    WeakValidator,
)
from ownership.models import Resource, ResourceKind, ResourceVersion

__all__ = [
    "ADAPTER_OF_TARGET",
    "HTTP_DIALECT_DEFAULTS",
    "adapter_for_kind",
    "adapter_for_settings",
    "adapter_settings",
    "in_caller_transaction",
    "is_external",
]


def current_state(kind: ResourceKind, resource: Resource) -> tuple[dict[str, Any], str]:
    """What a conflict shows as `current` (`{}` when absent) and its version token.

    Managed: read through the kind's adapter, in the caller's transaction (the row as it is
    now). A tombstone reads as absent; its token is still the row's counter (a resolution
    observes it). External: the mirror row — the target's own answer, recorded with its
    token by the write or read that found the conflict, just before this transaction; a
    second read here would hold the conflict's row locks across a network call."""
    if is_external(kind):
        return ({} if resource.deleted else copy.deepcopy(resource.document)), resource.token
    snapshot = adapter_for_kind(kind).read(resource.name)
    if snapshot.version is None:
        return {}, resource.token
    return copy.deepcopy(snapshot.document), snapshot.version


def mirror_snapshot(
    kind: ResourceKind,
    name: str,
    snapshot: Snapshot,
    *,
    operation: str = "read",
    fence: int = 0,
    run_id: Any = None,
    action_id: Any = None,
    guard_fence: int = 0,
) -> Resource | None:
    """Record what the target holds for kind/name: a new token becomes a new mirror revision
    (with its history row); the same token changes nothing. Absent at the target: the
    mirror (if any) becomes a tombstone. Returns the mirror row (None: never seen, absent).

    `guard_fence`: the fence of the resource's lock held while `snapshot` was read (0: no
    lock — a plain read). The mirror row keeps the newest such fence in `last_fence`, the
    store's own check (a lock's TTL can pass while its holder is paused): a holder whose
    fence is older than the one that last recorded read the target before that one wrote,
    so its snapshot is older than the mirror and is not recorded — the row is returned as
    it is. `fence` is only the history row's attribution (the attempt that wrote)."""
    with transaction.atomic():
        resource = mirror_locked(kind.pk, name)
        if resource is not None and guard_fence and resource.last_fence > guard_fence:
            return resource  # a newer holder recorded since this snapshot was read
        if resource is None:
            if not snapshot.exists:
                return None
            return _mirror_create(
                kind, name, snapshot, operation, fence, run_id, action_id, guard_fence
            )
        raised = guard_fence > resource.last_fence
        if raised:
            resource.last_fence = guard_fence
        if not snapshot.exists:
            if resource.deleted:
                return _fence_kept(resource, raised)
            return _mirror_revise(
                resource,
                resource.document,
                resource.token,
                True,
                operation,
                fence,
                run_id,
                action_id,
            )
        if resource.external_version == snapshot.version and not resource.deleted:
            return _fence_kept(resource, raised)
        assert snapshot.version is not None
        return _mirror_revise(
            resource,
            snapshot.document,
            snapshot.version,
            False,
            operation,
            fence,
            run_id,
            action_id,
        )


def _fence_kept(resource: Resource, raised: bool) -> Resource:
    """Nothing new to record, but a newer guard fence (`raised`) is kept: an older holder
    resuming later must not record what it read before this one confirmed the row."""
    if raised:
        Resource.objects.filter(pk=resource.pk).update(last_fence=resource.last_fence)
    return resource


def _mirror_create(
    kind: ResourceKind,
    name: str,
    snapshot: Snapshot,
    operation: str,
    fence: int,
    run_id: Any,
    action_id: Any,
    guard_fence: int,
) -> Resource:
    try:
        with transaction.atomic():
            resource = Resource.objects.create(
                kind=kind,
                name=name,
                document=copy.deepcopy(snapshot.document),
                version=1,
                external_version=snapshot.version,
                owner_group=kind.owner_group,
                last_fence=guard_fence,
            )
    except IntegrityError:
        # Another reader created the mirror first: record this answer as a revision of it.
        resource = Resource.objects.select_for_update().get(kind=kind, name=name)
        if guard_fence and resource.last_fence > guard_fence:
            return resource  # a newer holder recorded since this snapshot was read
        raised = guard_fence > resource.last_fence
        resource.last_fence = max(resource.last_fence, guard_fence)
        if resource.external_version == snapshot.version:
            return _fence_kept(resource, raised)
        assert snapshot.version is not None
        return _mirror_revise(
            resource,
            snapshot.document,
            snapshot.version,
            False,
            operation,
            fence,
            run_id,
            action_id,
        )
    _history(resource, operation, fence, run_id, action_id)
    return resource


def _mirror_revise(
    resource: Resource,
    document: Any,
    token: str,
    deleted: bool,
    operation: str,
    fence: int,
    run_id: Any,
    action_id: Any,
) -> Resource:
    resource.version += 1
    resource.document = copy.deepcopy(document)
    resource.external_version = token
    resource.deleted = deleted
    resource.save(
        update_fields=[
            "version",
            "document",
            "external_version",
            "deleted",
            "last_fence",
            "updated_at",
        ]
    )
    _history(resource, operation, fence, run_id, action_id)
    return resource


def _history(resource: Resource, operation: str, fence: int, run_id: Any, action_id: Any) -> None:
    ResourceVersion.objects.create(
        resource=resource,
        version=resource.version,
        external_version=resource.external_version,
        document=resource.document,
        deleted=resource.deleted,
        operation=operation[:16],
        fence=fence,
        run_id=run_id,
        action_id=action_id,
    )


class TargetUnavailable(DomainError):
    code = "target_unavailable"


class TargetWeakValidator(DomainError):
    code = "weak_validator"


def read_through(kind: ResourceKind, name: str) -> Resource | None:
    """Read kind/name from its target and refresh the mirror; the mirror row (None: the
    target has no such document and Airlock never saw one). Raises TargetUnavailable (502,
    retryable) when the target cannot be read or is misconfigured, TargetWeakValidator (502)
    when it hands out a version that cannot guard a write — never a blind write later."""
    try:
        snapshot = adapter_for_kind(kind).read(name)
    except WeakValidator as exc:
        raise TargetWeakValidator(str(exc), extra={"resource": f"{kind.slug}/{name}"}) from None
    except (TargetError, TargetConfigError) as exc:
        raise TargetUnavailable(
            f"{kind.slug}/{name}: the target could not be read ({exc}).",
            extra={"resource": f"{kind.slug}/{name}"},
        ) from None
    return mirror_snapshot(kind, name, snapshot)


def refresh_mirror(kind: ResourceKind, name: str, if_match_etag: str | None) -> None:
    """Before a proposal (a single write or a plan's step) on an external kind: the mirror
    must hold the version the agent names, so the approver sees the diff against what the
    agent read, the precondition is checked against it and the conflict page and the undo
    have its document. Read from the target unless the mirror already does (a create names
    no version: always read, so a document already there refuses it now, not at execution).
    Raises what read_through raises."""
    mirror = Resource.objects.filter(kind=kind, name=name).first()
    if not mirror_is_current(mirror, if_match_etag):
        read_through(kind, name)


def mirror_is_current(resource: Resource | None, if_match_etag: str | None) -> bool:
    """Whether the mirror already holds the version an agent names (no read needed: the
    target's own conditional write is the last word either way)."""
    return (
        resource is not None
        and not resource.deleted
        and if_match_etag is not None
        and resource.etag == if_match_etag
    )
