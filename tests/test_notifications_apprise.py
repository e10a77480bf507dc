"""Apprise address checks: a subscription's Apprise URL must name exactly one service
Apprise supports (not its generic HTTP targets), checked when it is created or edited
through the API or the console's form; a refusal is a 422 naming `url`, stores nothing,
and never repeats the URL — its tokens stay out of answers, pages, logs and audit."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from audit.models import AuditEvent
from notifications.models import Subscription
from notifications.services.channels import apprise_url_display, apprise_url_problem
from notifications.services.secrets import unseal
from tests.fixtures.api import problem
from tests.fixtures.console import People, client_for

pytestmark = pytest.mark.django_db

BASE = "/api/v1/subscriptions"
TOKEN = "Tok3nSecret"
GOOD = f"ntfys://ntfy.example.org/{TOKEN}Topic"
CHAT = {"name": "on-call chat", "target": "operators", "channel": "apprise", "url": GOOD}

# (URL, what the refusal says): each carries the token somewhere.
REFUSED = [
    (f"slack://{TOKEN}AAA", "Apprise cannot read this slack:// URL"),  # tokens missing
    (f"{TOKEN}://hooks.example.org", "not the URL of a service Apprise supports"),
    (f"https://example.org/{TOKEN}", "a plain HTTPS endpoint is a webhook subscription"),
    (f"msteams://team/{TOKEN}/b/c", "not the URL of a service Apprise supports"),  # gone
    (f"json://127.0.0.1/{TOKEN}", "json:// is not a chat or paging service"),
    (f"forms://hooks.example.org/{TOKEN}", "forms:// is not a chat or paging service"),
    ("syslog://local5", "syslog:// is not a chat or paging service"),
    # Several services in one: the second would dodge the check of the first's scheme.
    (f"{GOOD}, json://127.0.0.1/{TOKEN}", "one Apprise URL per subscription"),
    (f"{GOOD} discord://123/{TOKEN}", "one Apprise URL per subscription"),
    ("", "required for this channel"),
]

ACCEPTED = [
    ("slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ/#general", "slack://…"),
    ("https://hooks.slack.com/services/T1JJ3T3L2/A1BRTD4JD/TIiajkdnl", "https://hooks.slack.com/…"),
    (
        "workflows://prod-12.westeurope.logic.azure.com/wf/sig",
        "workflows://prod-12.westeurope.logic.azure.com/…",
    ),
    (f"discord://123456/{TOKEN}", "discord://…"),
    (f"mmosts://chat.example.org/{TOKEN}", "mmosts://chat.example.org/…"),
    (GOOD, "ntfys://ntfy.example.org/…"),
    # The host's place holds a token here: never shown.
    (f"pagerduty://{TOKEN}Integration@{TOKEN}ApiKey/", "pagerduty://…"),
    (f"tgram://123456789:{TOKEN}AAAAAAAAAAAAAAAAAAAAAAAAAA/12345", "tgram://…"),
]


@pytest.mark.parametrize(("url", "says"), REFUSED[:-1])  # "" is the service's own rule
def test_each_unusable_apprise_url_is_refused_without_repeating_it(url: str, says: str) -> None:
    problem_text = apprise_url_problem(url)
    assert says in problem_text
    assert TOKEN not in problem_text


@pytest.mark.parametrize(("url", "shown"), ACCEPTED)
def test_a_usable_apprise_url_is_accepted_and_shown_without_its_tokens(
    url: str, shown: str
) -> None:
    assert apprise_url_problem(url) == ""
    assert apprise_url_display(url) == shown


def _no_token_in(*texts: str) -> None:
    for text in texts:
        assert TOKEN not in text


@pytest.mark.parametrize(("url", "says"), REFUSED)
def test_the_api_refuses_a_bad_apprise_url_with_a_422_and_stores_nothing(
    api: Any, admin: Any, caplog: pytest.LogCaptureFixture, url: str, says: str
) -> None:
    caplog.set_level(logging.DEBUG)
    response = api.post(BASE, token=admin.token, body={**CHAT, "url": url})
    body = problem(response, 422, "validation_error")
    assert body["errors"] == [{"field": "url", "message": body["errors"][0]["message"]}]
    assert says in body["errors"][0]["message"]
    _no_token_in(response.content.decode(), caplog.text)
    assert not Subscription.objects.exists()
    assert not AuditEvent.objects.filter(event_type__startswith="notification_").exists()


def test_the_schema_refusal_of_an_overlong_url_does_not_repeat_it(
    api: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"slack://{TOKEN}/" + "x" * 2000
    response = api.post(BASE, token=admin.token, body={**CHAT, "url": url})
    body = problem(response, 422, "validation_error")
    assert body["errors"][0]["field"].endswith("url")
    _no_token_in(response.content.decode(), caplog.text)
    assert not Subscription.objects.exists()


def test_editing_to_a_bad_apprise_url_is_refused_and_keeps_the_old_one(
    api: Any, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    created = api.post(BASE, token=admin.token, body=CHAT)
    assert created.status_code == 201, created.content
    identifier = json.loads(created.content)["id"]
    caplog.set_level(logging.DEBUG)
    for url, says in REFUSED:
        response = api.patch(f"{BASE}/{identifier}", token=admin.token, body={"url": url})
        body = problem(response, 422, "validation_error")
        assert says in body["detail"], url
        _no_token_in(response.content.decode())
    _no_token_in(caplog.text)
    stored = Subscription.objects.get()
    assert unseal(stored.url_encrypted) == GOOD
    assert stored.url_display == "ntfys://ntfy.example.org/…"
    assert not AuditEvent.objects.filter(event_type="notification_subscription.updated").exists()


def test_a_token_in_the_host_stays_out_of_answers_and_audit(api: Any, admin: Any) -> None:
    url = f"pagerduty://{TOKEN}Integration@{TOKEN}ApiKey/"
    created = api.post(BASE, token=admin.token, body={**CHAT, "url": url})
    assert created.status_code == 201, created.content
    assert json.loads(created.content)["url"] == "pagerduty://…"
    listed = api.get(BASE, token=admin.token)
    replaced = api.patch(
        f"{BASE}/{json.loads(created.content)['id']}",
        token=admin.token,
        body={"url": f"tgram://123456789:{TOKEN}AAAAAAAAAAAAAAAAAAAAAAAAAA/12345"},
    )
    assert replaced.status_code == 200, replaced.content
    audit = json.dumps(
        list(AuditEvent.objects.filter(event_type__startswith="notification_").values("details")),
        ensure_ascii=False,
    )
    _no_token_in(
        created.content.decode(), listed.content.decode(), replaced.content.decode(), audit
    )
    assert "tgram://…" in audit


FORM = {"name": "on-call chat", "target": "operators", "channel": "apprise"}


@pytest.mark.parametrize(("url", "says"), REFUSED[:-1])
def test_the_form_shows_why_an_apprise_url_is_refused_without_echoing_it(
    people: People, caplog: pytest.LogCaptureFixture, url: str, says: str
) -> None:
    caplog.set_level(logging.DEBUG)
    response = client_for(people.admin).post(
        "/notifications/new/", {**FORM, "url": url}, HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert response.status_code == 422
    assert says.replace("'", "&#x27;") in html
    _no_token_in(html, caplog.text)
    assert not Subscription.objects.exists()
    assert not AuditEvent.objects.filter(event_type__startswith="notification_").exists()


def test_the_form_takes_a_good_apprise_url(people: People) -> None:
    response = client_for(people.admin).post(
        "/notifications/new/", {**FORM, "url": GOOD}, HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 200
    _no_token_in(response.content.decode())
    assert unseal(Subscription.objects.get().url_encrypted) == GOOD
