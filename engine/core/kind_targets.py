"""A kind's target adapter (issue 39): Airlock's own store for a managed kind
(engine/core/managed_target.py), else the adapter of its external system (engine/targets).

Here, in the core, so that the barrier, undo and the executor reach a kind's documents only
through the adapter and choose their path by what it can do (`Capabilities`), never by the
kind's target name. ownership/targets.py re-exports these for the services and pages.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from engine.core.managed_target import ManagedTarget
from engine.targets import registry
from engine.targets.base import TargetAdapter, TargetConfigError
from ownership.models import ResourceKind, TargetType

# Which engine adapter serves each external target.
ADAPTER_OF_TARGET = {
    TargetType.HTTP: "http_etag",
    TargetType.POSTGRES: "postgres",
    TargetType.GIT: "git",
}

# A kind stored with `{"target": "http", "target_url": …}` and no settings keeps the meaning
# that representation had before settings existed: a service speaking Airlock's own dialect,
# which honours both our Idempotency-Key and our Fencing-Token.
HTTP_DIALECT_DEFAULTS = {"honours_idempotency_key": True, "honours_fencing_token": True}


def is_external(kind: ResourceKind) -> bool:
    """Whether the kind's documents live outside Airlock (read through, mirrored)."""
    return kind.target in ADAPTER_OF_TARGET


def adapter_settings(
    target: str, target_url: str, target_settings: dict[str, Any]
) -> dict[str, Any]:
    """The settings the engine adapter is built from (an http kind's URL is its base_url;
    its timeout defaults to AIRLOCK_TARGET_TIMEOUT_SECONDS, read at each call)."""
    built = dict(target_settings or {})
    if target == TargetType.HTTP:
        dialect = HTTP_DIALECT_DEFAULTS if not built else {}
        built = {"base_url": target_url, **dialect, **built}
        built.setdefault("timeout", float(settings.AIRLOCK_TARGET_TIMEOUT_SECONDS))
    return built


def adapter_for_settings(
    target: str, target_url: str, target_settings: dict[str, Any]
) -> TargetAdapter:
    """The adapter, or TargetConfigError naming the setting that is wrong."""
    return registry.adapter_for(
        ADAPTER_OF_TARGET[TargetType(target)],
        adapter_settings(target, target_url, target_settings),
    )


def adapter_for_kind(kind: ResourceKind) -> TargetAdapter:
    """The adapter that reaches the kind's documents: Airlock's own store
    (engine/core/managed_target.py, in the caller's transaction) for a managed kind, else
    the external target's (TargetConfigError naming the setting that is wrong)."""
    if not is_external(kind):
        return ManagedTarget(kind_id=kind.pk, owner_group=kind.owner_group)
    return adapter_for_settings(kind.target, kind.target_url, kind.target_settings)


def in_caller_transaction(kind: ResourceKind) -> bool:
    """Whether the kind's adapter writes inside the caller's transaction (its capabilities):
    then the write barrier records each write with it. A kind whose settings are wrong has
    no adapter: it is not (the external path fails its action, naming the setting)."""
    try:
        return adapter_for_kind(kind).capabilities.in_caller_transaction
    except TargetConfigError:
        return False
