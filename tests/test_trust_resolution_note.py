"""A conflict's settlement and its reopening are one write (ownership/reopen.py
`conflict_resolution_set`): the conflicted action's note, ETag and `updated_at` move
the same way whether a person resolves the conflict or the resolution is undone."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Action
from approvals.services.actions import action_cancel
from audit.services import Actor
from tests.test_trust_resolution import _conflict, _resolve, world  # noqa: F401

pytestmark = pytest.mark.django_db


def test_resolving_and_reopening_each_move_the_conflicted_actions_etag_and_time(
    world: Any,  # noqa: F811
) -> None:
    conflict = _conflict(world, quorum=1)
    before = Action.objects.get(pk=conflict.action_id)

    resolution = _resolve(world, conflict)
    resolved = Action.objects.get(pk=conflict.action_id)
    assert resolved.error["resolution"]["choice"] == "take_proposed"
    assert resolved.error["resolution"]["action"] == str(resolution.pk)
    assert resolved.revision == before.revision + 1
    assert resolved.updated_at > before.updated_at

    action_cancel(action=resolution, actor=Actor.person(world.operator))
    reopened = Action.objects.get(pk=conflict.action_id)
    assert reopened.error["resolution"] is None
    assert reopened.revision == resolved.revision + 1
    assert reopened.updated_at > resolved.updated_at
    conflict.refresh_from_db()
    assert conflict.status == "open" and conflict.resolved_by_id is None
    assert conflict.resolution_fields == {} and conflict.resolution_comment == ""
