"""One rule for who may read an action (approvals.selectors.actions_visible_to),
used by the API and by the console pages alike (issue 10: three copies -> one)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from approvals.models import Run
from approvals.selectors import actions_visible_to
from tests.fixtures.api import make_active_run, make_person_with_token
from tests.fixtures.core import make_action


@pytest.mark.django_db
def test_it_lets_a_live_runs_token_read_its_agents_actions_and_an_ended_one_only_its_own(
    api: Any, run: Any
) -> None:
    own = make_action(run=run.run, identifier="dns-record/app-1", operation="create")
    sibling = make_active_run(
        run.agent, [{"resource": "dns-record/web-*", "operations": ["create"]}]
    )
    siblings = make_action(run=sibling.run, identifier="dns-record/web-1", operation="create")

    assert set(actions_visible_to(run.run)) == {own, siblings}
    listed = json.loads(api.get("/api/v1/actions", token=run.token).content)
    assert {item["id"] for item in listed["items"]} == {str(own.pk), str(siblings.pk)}

    Run.objects.filter(pk=run.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    run.run.refresh_from_db()

    assert set(actions_visible_to(run.run)) == {own}
    assert api.get(f"/api/v1/actions/{own.pk}", token=run.token).status_code == 200
    assert api.get(f"/api/v1/actions/{siblings.pk}", token=run.token).status_code == 404
    # The agent itself still reads both.
    assert set(actions_visible_to(run.agent)) == {own, siblings}


@pytest.mark.django_db
def test_the_api_and_the_console_page_agree_on_who_reads_an_action(
    api: Any, run: Any, operator: Any, owner: Any, outsider: Any
) -> None:
    platform_action = make_action(run=run.run, identifier="dns-record/web-1", operation="create")
    auditor = make_person_with_token("audrey", "auditors")
    expected = {"ana": True, "olga": True, "otto": False, "audrey": True}
    for person in (operator, owner, outsider, auditor):
        visible = actions_visible_to(person.user).filter(pk=platform_action.pk).exists()
        api_status = api.get(f"/api/v1/actions/{platform_action.pk}", token=person.token)
        page = Client()
        page.force_login(person.user)
        page_status = page.get(f"/actions/{platform_action.pk}/")
        name = person.user.get_username()
        assert visible is expected[name], name
        assert api_status.status_code == (200 if visible else 404), name
        assert page_status.status_code == (200 if visible else 404), name
