"""From a kind's target name and settings to its adapter, and the settings check the kind
API will call before it stores them (issue 39 §2: refused with a clear error).

`managed` is not here: its adapter (engine/core/managed_target.py) needs the ORM and is
built by engine/core/kind_targets.py `adapter_for_kind`. Today's `http` kind is `http_etag` with
Airlock's dialect flags on (ownership/targets.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.targets.base import TargetAdapter, TargetConfigError
from engine.targets.git import GitSettings, GitTarget
from engine.targets.http_etag import HttpEtagSettings, HttpEtagTarget
from engine.targets.postgres import PostgresSettings, PostgresTarget


def _postgres(settings: Mapping[str, Any]) -> TargetAdapter:
    return PostgresTarget(PostgresSettings.from_settings(settings))


def _http_etag(settings: Mapping[str, Any]) -> TargetAdapter:
    return HttpEtagTarget(HttpEtagSettings.from_settings(settings))


def _git(settings: Mapping[str, Any]) -> TargetAdapter:
    return GitTarget(GitSettings.from_settings(settings))


ADAPTERS: dict[str, Callable[[Mapping[str, Any]], TargetAdapter]] = {
    "postgres": _postgres,
    "http_etag": _http_etag,
    "git": _git,
}


def adapter_for(target: str, settings: Mapping[str, Any]) -> TargetAdapter:
    """The adapter of a kind; TargetConfigError names what is wrong with its settings."""
    make = ADAPTERS.get(target)
    if make is None:
        raise TargetConfigError(
            f"target: {target!r} has no adapter (one of: {', '.join(sorted(ADAPTERS))})"
        )
    return make(settings)
