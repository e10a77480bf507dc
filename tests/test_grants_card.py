"""Issue 42 §2 in the console: the inbox card's "Approve and allow similar" form approves the
write and grants the run standing approval for similar ones (the decision service's checks:
caps, the prefix inside the run's write set); a bad value is a 422 on the card that decides
nothing."""

from __future__ import annotations

from typing import Any

import pytest

from approvals.models import Approval, Grant
from ownership.models import ConflictClass
from tests.fixtures.api import ApiClient, make_agent_with_token, make_person_with_token
from tests.fixtures.console import client_for
from tests.test_grants import _create, _flags_run, _pending_approval

pytestmark = pytest.mark.django_db


@pytest.fixture
def flags() -> Any:
    return _flags_run(make_agent_with_token("flag-bot").agent)


def _post(person: Any, approval: Approval, **fields: str) -> Any:
    data = {"comment": "same flag family", "grant": "1", "grant_prefix": "team-a-", **fields}
    # As htmx posts it from the card: the answer is the card itself.
    return client_for(person.user).post(
        f"/approvals/{approval.pk}/decision/", data, headers={"HX-Request": "true"}
    )


def test_the_cards_grant_form_approves_and_admits_the_next_similar_write(flags: Any) -> None:
    api = ApiClient()
    operator = make_person_with_token("ana", "operators")
    approval = _pending_approval(api, flags, "team-a-one")
    response = _post(operator, approval, grant_uses="2", grant_minutes="30")
    assert response.status_code == 200, response.content
    approval.refresh_from_db()
    assert approval.status == "approved"
    grant = Grant.objects.get(approval=approval)
    assert (grant.uses, grant.name_prefix, grant.owner_id) == (2, "team-a-", operator.user.pk)
    # The decided card says what was granted.
    assert f"You granted standing grant #{grant.pk}: 2 more writes" in response.content.decode()
    admitted = _create(api, flags, "team-a-two").json()
    assert admitted["status"] == "queued"
    # Its action page names the grant instead of "no per-call approval".
    page = client_for(operator.user).get(f"/actions/{admitted['id']}/").content.decode()
    assert f"Approved without asking by standing grant #{grant.pk} of ana" in page


def test_a_bad_grant_value_on_the_card_decides_nothing(flags: Any) -> None:
    api = ApiClient()
    operator = make_person_with_token("ana", "operators")
    approval = _pending_approval(api, flags, "team-a-one")
    response = _post(operator, approval, grant_uses="lots", grant_minutes="30")
    assert response.status_code == 422, response.content
    assert b"uses" in response.content  # the card names the field
    approval.refresh_from_db()
    assert approval.status == "pending" and not Grant.objects.exists()


def test_the_rules_page_lists_grants_and_their_owner_revokes_one(flags: Any) -> None:
    api = ApiClient()
    operator = make_person_with_token("ana", "operators")
    approval = _pending_approval(api, flags, "team-a-one")
    assert _post(operator, approval, grant_uses="3", grant_minutes="60").status_code == 200
    grant = Grant.objects.get(approval=approval)
    client = client_for(operator.user)
    page = client.get("/rules/").content.decode()
    row = page[page.index(f'id="grant-{grant.pk}"') :].split("</tr>")[0]
    assert "3 of 3" in row and "min" in row and "live" in row, row
    revoked = client.post(f"/grants/{grant.pk}/revoke/", headers={"HX-Request": "true"})
    assert revoked.status_code == 200 and "admits nothing" in revoked.content.decode()
    grant.refresh_from_db()
    assert grant.revoked_at is not None
    assert _create(api, flags, "team-a-two").json()["status"] == "pending_approval"
    other = make_person_with_token("bo", "operators")
    refused = client_for(other.user).post(f"/grants/{grant.pk}/revoke/")
    assert refused.status_code in (302, 403)


def test_a_card_whose_class_forbids_grants_offers_no_grant_form(flags: Any) -> None:
    """A form that could only be refused is not offered: the card of a write whose class
    forbids grants (replace_shared_document by default) has no "Approve and allow
    similar"; the card of one whose class allows them has it."""
    api = ApiClient()
    operator = make_person_with_token("ana", "operators")
    approval = _pending_approval(api, flags, "team-a-one")
    inbox = client_for(operator.user).get("/approvals/").content.decode()
    assert f'id="grant-prefix-{approval.pk}"' in inbox
    assert approval.action is not None
    ConflictClass.objects.filter(pk=approval.action.conflict_class_id).update(grants_allowed=False)
    inbox = client_for(operator.user).get("/approvals/").content.decode()
    assert f'id="approval-{approval.pk}"' in inbox
    assert f'id="grant-prefix-{approval.pk}"' not in inbox
