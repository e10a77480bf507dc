"""Sign-in, lockout, CSP, Vary and the layout shared by every page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.test import Client

from tests.fixtures.console import PASSWORD, People, World, client_for

pytestmark = pytest.mark.django_db

MAIN_PAGES = ["/", "/approvals/", "/conflicts/", "/runs/", "/resources/", "/catalog/", "/tokens/"]
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


@pytest.mark.parametrize("path", [*MAIN_PAGES, "/audit/"])
def test_every_page_asks_an_anonymous_visitor_to_sign_in(path: str) -> None:
    response = Client().get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


def test_a_person_signs_in_with_a_password_and_lands_on_the_dashboard(people: People) -> None:
    client = Client()
    page = client.get("/login/")
    assert page.status_code == 200 and b'name="csrfmiddlewaretoken"' in page.content
    response = client.post("/login/", {"username": "olivia", "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200


def test_repeated_failures_lock_the_username_out_even_for_the_right_password(
    people: People, settings: object
) -> None:
    client = Client()
    for _ in range(5):
        response = client.post("/login/", {"username": "olivia", "password": "wrong"})
    assert response.status_code == 429
    assert b"Too many failed sign-ins" in response.content
    locked = client.post("/login/", {"username": "olivia", "password": PASSWORD})
    assert locked.status_code == 429
    assert "_auth_user_id" not in client.session


def test_sign_out_is_a_post_that_ends_the_session(people: People) -> None:
    client = client_for(people.operator)
    assert client.get("/logout/").status_code == 405
    response = client.post("/logout/")
    assert response.status_code == 302
    assert client.get("/").status_code == 302


@pytest.mark.parametrize("path", MAIN_PAGES)
def test_pages_carry_a_strict_csp_and_vary_on_hx_request(
    people: People, world: World, path: str
) -> None:
    response = client_for(people.admin).get(path)
    assert response.status_code == 200
    csp = response["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "HX-Request" in response["Vary"]
    html = response.content.decode()
    assert 'hx-headers=\'{"X-CSRFToken"' in html
    assert '"allowEval": false' in html and '"includeIndicatorStyles": false' in html


def test_templates_hold_no_inline_script_style_or_event_handler() -> None:
    for template in TEMPLATES.rglob("*.html"):
        text = template.read_text()
        for match in re.finditer(r"<script\b[^>]*>", text):
            assert "src=" in match.group(0), f"inline <script> in {template}"
        assert "<style" not in text, template
        assert not re.search(r"\sstyle=", text), f"inline style attribute in {template}"
        assert not re.search(r"\son[a-z]+=", text), f"inline event handler in {template}"
        assert "hx-on" not in text, f"hx-on needs eval: {template}"
        assert "js:" not in text and "javascript:" not in text, template


def test_htmx_is_vendored_and_served_locally(people: People) -> None:
    html = client_for(people.operator).get("/").content.decode()
    assert '<script src="/static/vendor/htmx.min.js"' in html
    assert "unpkg" not in html and "cdn" not in html.lower()
    assert (TEMPLATES.parent / "static" / "vendor" / "htmx.min.js").stat().st_size > 40_000


def test_the_nav_shows_the_person_and_their_roles(people: People) -> None:
    html = client_for(people.owner).get("/").content.decode()
    assert "pat" in html and "platform" in html


NEW_CLASS = {
    "slug": "x",
    "name": "X",
    "approval_mode": "per_call",
    "on_conflict": "request_review",
    "resolver": "owner",
    "quorum": "1",
    "undo_window_seconds": "0",
    "approval_ttl_seconds": "3600",
    "escalation_seconds": "0",
}


def test_a_refusal_says_why_as_a_page_or_as_a_fragment(people: People, world: World) -> None:
    client = client_for(people.outsider)
    page = client.post(f"/runs/{world.run.id}/revoke/", {"reason": "x"})
    assert page.status_code == 404  # not even visible
    # The refusal is the catalog verb's own (ownership/catalog.py), shown by the page.
    refused = client.post("/catalog/classes/", NEW_CLASS)
    html = refused.content.decode()
    assert refused.status_code == 403 and "<html" in html
    assert "Only admins edit the conflict-class table and resource kinds." in html
    fragment = client.post("/catalog/classes/", NEW_CLASS, HTTP_HX_REQUEST="true")
    assert fragment.status_code == 403
    assert "<html" not in fragment.content.decode()
    assert "Only admins edit the conflict-class table" in fragment.content.decode()


def test_htmx_swaps_the_explained_4xx_fragments(people: People) -> None:
    html = client_for(people.operator).get("/").content.decode()
    assert '{"code": "(403|409|422)", "swap": true, "error": false}' in html


def test_every_model_is_in_the_admin_and_history_is_read_only(people: People, world: World) -> None:
    from django.apps import apps
    from django.contrib import admin

    from tests.fixtures.console import make_person

    superuser = make_person("root", superuser=True)
    client = client_for(superuser)
    for app in ("ownership", "approvals", "console", "audit"):
        for model in apps.get_app_config(app).get_models():
            assert model in admin.site._registry, f"{model.__name__} is not in the admin"
            url = f"/admin/{app}/{model._meta.model_name}/"
            assert client.get(url).status_code == 200, url
    history = [
        ("ownership", "resourceversion"),
        ("audit", "auditevent"),
        ("approvals", "operation"),
        ("approvals", "approvaldecision"),
        ("approvals", "idempotencyrecord"),
        ("approvals", "plan"),
        ("approvals", "planstep"),
        # Changed only through audited services, never in the admin:
        ("approvals", "agent"),
        ("approvals", "autoapproverule"),
        ("auth", "user"),
        ("auth", "group"),
    ]
    for app, name in history:
        model = apps.get_model(app, name)
        model_admin = admin.site._registry[model]
        assert not model_admin.has_add_permission(None)  # type: ignore[arg-type]
        assert not model_admin.has_change_permission(None)  # type: ignore[arg-type]
        assert not model_admin.has_delete_permission(None)  # type: ignore[arg-type]
    assert client.get(f"/admin/ownership/resource/{world.resource.pk}/change/").status_code == 200
