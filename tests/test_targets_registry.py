"""engine/targets/registry.py: a kind's target name and settings to its adapter."""

from __future__ import annotations

import pytest

from engine.targets.base import TargetAdapter, TargetConfigError
from engine.targets.git import GitTarget
from engine.targets.http_etag import HttpEtagTarget
from engine.targets.postgres import PostgresTarget
from engine.targets.registry import adapter_for


def test_each_target_gets_its_adapter_and_each_adapter_is_the_interface() -> None:
    made = [
        adapter_for(
            "postgres",
            {"credentials_env": "DB", "table": "t", "key_column": "k", "document_column": "d"},
        ),
        adapter_for("http_etag", {"base_url": "https://objects.example/bucket"}),
        adapter_for("git", {"repository": "/srv/config.git", "branch": "main"}),
    ]
    assert [type(a) for a in made] == [PostgresTarget, HttpEtagTarget, GitTarget]
    assert all(isinstance(a, TargetAdapter) for a in made)


@pytest.mark.parametrize("target", ["managed", "http", "s3", ""])
def test_a_target_without_an_adapter_is_refused_by_name(target: str) -> None:
    with pytest.raises(TargetConfigError, match="has no adapter"):
        adapter_for(target, {})


def test_bad_settings_surface_as_a_config_error() -> None:
    with pytest.raises(TargetConfigError, match="table"):
        adapter_for(
            "postgres",
            {"credentials_env": "DB", "table": "x;y", "key_column": "k", "document_column": "d"},
        )
