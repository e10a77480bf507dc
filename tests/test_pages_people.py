"""People: admins create people, change their roles and owner groups, and
deactivate them (audited once per change); auditors read; others are refused."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

from approvals.services.tokens import personal_token_create, principal_for_token
from audit.models import AuditEvent
from audit.services import Actor
from console.people import person_create, person_groups, person_set_active, person_update
from engine.core.errors import Forbidden, ValidationFailed
from tests.fixtures.console import People, client_for, post_form

pytestmark = pytest.mark.django_db

HX = {"HTTP_HX_REQUEST": "true"}
NEW = {
    "username": "nina",
    "password": "a-long-enough-passphrase-42",
    "roles": ["owner"],
    "groups": "platform, release-owners",
}


def _events(event_type: str) -> int:
    return AuditEvent.objects.filter(event_type=event_type).count()


def test_an_admin_creates_a_person_who_can_sign_in(people: People) -> None:
    post_form(people.admin, "/people/new/", NEW, redirects_to="/people/")
    nina = User.objects.get(username="nina")
    assert person_groups(nina) == (["owner"], ["platform", "release-owners"])
    signed_in = Client().post("/login/", {"username": "nina", "password": NEW["password"]})
    assert signed_in.status_code == 302
    assert _events("person.created") == 1
    event = AuditEvent.objects.get(event_type="person.created")
    assert NEW["password"] not in str(event.details)


def test_with_htmx_the_page_fragment_comes_back_with_a_trigger(people: People) -> None:
    response = client_for(people.admin).post("/people/new/", NEW, **HX)
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" not in html and 'id="people-page"' in html and "nina can now sign in" in html
    assert "people-changed" in response["HX-Trigger"]
    assert NEW["password"] not in html


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"username": "olivia"}, "olivia already exists"),
        ({"username": "bad name!"}, "letters, digits"),
        ({"password": "short"}, "too short"),
        ({"roles": ["superhero"]}, "Select a valid choice"),
        ({"roles": []}, "This field is required"),
        ({"groups": "operators"}, "not a role group"),
        ({"groups": "bad/group"}, "bad owner group"),
    ],
)
def test_bad_input_is_a_422_and_nobody_is_created(
    people: People, change: dict[str, object], message: str
) -> None:
    before = User.objects.count()
    response = client_for(people.admin).post("/people/new/", {**NEW, **change}, **HX)
    assert response.status_code == 422
    assert message in response.content.decode()
    assert "HX-Trigger" not in response
    assert User.objects.count() == before
    assert _events("person.created") == 0


def test_an_admin_changes_roles_and_groups_once(people: People) -> None:
    client = client_for(people.admin)
    form = client.get(f"/people/?edit={people.owner.pk}").content.decode()
    assert "Roles and groups of pat" in form and 'value="platform"' in form
    change = {"roles": ["owner", "operator"], "groups": "platform payments"}
    response = client.post(f"/people/{people.owner.pk}/", change, **HX)
    assert response.status_code == 200 and "roles and groups saved" in response.content.decode()
    assert person_groups(people.owner) == (["operator", "owner"], ["payments", "platform"])
    again = client.post(f"/people/{people.owner.pk}/", change)
    assert again.status_code == 302
    assert _events("person.updated") == 1
    details = AuditEvent.objects.get(event_type="person.updated").details
    assert details["roles"] == {"from": ["owner"], "to": ["operator", "owner"]}


def test_an_admin_cannot_drop_their_own_admin_role(people: People) -> None:
    response = client_for(people.admin).post(
        f"/people/{people.admin.pk}/", {"roles": ["operator"], "groups": ""}
    )
    assert response.status_code == 422
    assert "cannot remove your own admin role" in response.content.decode()
    assert person_groups(people.admin) == (["admin"], [])


def test_deactivating_stops_sign_in_and_tokens_and_is_audited_once(people: People) -> None:
    _token, secret = personal_token_create(user=people.owner, actor=Actor.system("test"))
    owner_session = client_for(people.owner)
    client = client_for(people.admin)
    response = client.post(f"/people/{people.owner.pk}/active/", {"active": "0"}, **HX)
    assert response.status_code == 200 and "pat deactivated" in response.content.decode()
    assert "people-changed" in response["HX-Trigger"]
    again = client.post(f"/people/{people.owner.pk}/active/", {"active": "0"}, **HX)
    assert "already deactivated" in again.content.decode()
    assert _events("person.deactivated") == 1
    assert principal_for_token(secret) is None
    assert owner_session.get("/").status_code == 302  # the open session ends too
    assert client.post(f"/people/{people.owner.pk}/active/", {"active": "1"}).status_code == 302
    assert principal_for_token(secret) is not None
    assert _events("person.activated") == 1


def test_an_admin_cannot_deactivate_themselves(people: People) -> None:
    response = client_for(people.admin).post(f"/people/{people.admin.pk}/active/", {"active": "0"})
    assert response.status_code == 422
    people.admin.refresh_from_db()
    assert people.admin.is_active


@pytest.mark.parametrize("who", ["operator", "owner", "auditor", "outsider"])
def test_only_admins_manage_people(people: People, who: str) -> None:
    client = client_for(getattr(people, who))
    assert client.post("/people/new/", NEW).status_code == 403
    assert client.post(f"/people/{people.owner.pk}/", {"roles": ["admin"]}).status_code == 403
    assert client.post(f"/people/{people.owner.pk}/active/", {"active": "0"}).status_code == 403
    assert not User.objects.filter(username="nina").exists()
    people.owner.refresh_from_db()
    assert people.owner.is_active and person_groups(people.owner)[0] == ["owner"]
    assert not AuditEvent.objects.filter(event_type__startswith="person.").exists()


def test_auditors_read_the_list_and_others_are_refused(people: People) -> None:
    html = client_for(people.auditor).get("/people/").content.decode()
    assert "<code>pat</code>" in html and "Only admins create people" in html
    assert "Deactivate" not in html
    for who in (people.operator, people.owner, people.outsider):
        assert client_for(who).get("/people/").status_code == 403


def test_an_unknown_person_is_a_404(people: People) -> None:
    client = client_for(people.admin)
    assert client.post("/people/999999/", {"roles": ["owner"]}).status_code == 404
    assert client.post("/people/999999/active/", {"active": "0"}).status_code == 404


def test_the_list_is_a_bounded_number_of_queries(
    people: People, django_assert_max_num_queries: object
) -> None:
    client = client_for(people.admin)
    for n in range(20):
        User.objects.create_user(username=f"extra{n}")
    with django_assert_max_num_queries(10):  # type: ignore[operator]
        assert client.get("/people/").status_code == 200


def test_the_service_checks_the_role(people: People) -> None:
    with pytest.raises(Forbidden):
        person_create(user=people.operator, username="x", password="p" * 20, roles=["owner"])
    with pytest.raises(Forbidden):
        person_update(user=people.auditor, person_id=people.owner.pk, roles=["admin"])
    with pytest.raises(Forbidden):
        person_set_active(user=people.owner, person_id=people.operator.pk, active=False)
    with pytest.raises(ValidationFailed):
        person_update(user=people.admin, person_id=people.owner.pk, roles=[])


def test_the_list_pages_by_username_and_every_person_appears_once(people: People) -> None:
    from console.people_views import PEOPLE_PAGE_SIZE

    User.objects.bulk_create(
        [User(username=f"zz-person-{n:04d}") for n in range(PEOPLE_PAGE_SIZE + 20)]
    )
    client = client_for(people.admin)
    seen: list[str] = []
    url = "/people/"
    for _ in range(5):
        response = client.get(url)
        assert response.status_code == 200
        html = response.content.decode()
        seen += [u for u in html.split("<code>")[1:] for u in [u.split("</code>")[0]]]
        if "Next people" not in html:
            break
        after = html.split('href="?after=')[1].split('"')[0]
        url = f"/people/?after={after}"
    expected = sorted(User.objects.values_list("username", flat=True))
    assert [u for u in seen if u in expected] == expected
