"""Issue 38, item 7: a stranger who knows an operator's username cannot keep them out.

Failures lock the (username, client address) pair (django-axes) and throttle the
client's address; a username alone — failures for it from many addresses — only gets a
short delay that grows with them, never a lock (console/login_throttle.py,
docs/login-throttling.md). The delays are read from the product's own clock
(`login_throttle.clock`, moved here instead of sleeping) and from each refusal's
`Retry-After`.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from axes.models import AccessAttempt
from django.db.models import Max, Sum
from django.test import Client
from django.utils import timezone

from console import login_throttle
from tests.fixtures.api import start_api_server, stop_api_server
from tests.fixtures.console import PASSWORD, make_person

pytestmark = pytest.mark.django_db

ATTACKER = "203.0.113.66"
ANA_ELSEWHERE = "198.51.100.7"  # an address ana never signed in from
ANA_USUAL = "198.51.100.8"  # the address ana signs in from every day
PAIR_LOCK_SECONDS = 900  # AXES_COOLOFF_TIME, 0.25 h


@pytest.fixture
def people(db: Any, settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    make_person("ana", "operators")
    make_person("bob", "operators")


class Clock:
    """The product's clock for the delays: `ahead` seconds after the last recorded failure
    (django-axes stamps failures with the real time), so what a test reads does not depend
    on how long its requests took."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def now(self) -> datetime:
        last = AccessAttempt.objects.aggregate(last=Max("attempt_time"))["last"]
        return (last or timezone.now()) + timedelta(seconds=self.ahead)


@pytest.fixture
def clock(monkeypatch: Any) -> Clock:
    moved = Clock()
    monkeypatch.setattr(login_throttle, "clock", moved.now)
    return moved


def sign_in(username: str, password: str, address: str, path: str = "/login/") -> Any:
    return Client().post(path, {"username": username, "password": password}, REMOTE_ADDR=address)


def fail(username: str, address: str, clock: Clock, *, after: float = 0.0) -> None:
    """One wrong password, `after` seconds on the product's clock (past any delay due),
    then the clock back to now: the failure is counted (the form answers 200, or 429
    when it is the pair's last)."""
    clock.ahead = after
    response = sign_in(username, "wrong", address)
    clock.ahead = 0.0
    assert response.status_code in (200, 429), response.status_code
    assert "Retry-After" not in response or response.status_code == 429


def recorded_failures(**who: str) -> int:
    return int(
        AccessAttempt.objects.filter(**who).aggregate(n=Sum("failures_since_start"))["n"] or 0
    )


def refused(response: Any) -> int:
    """The refusal's Retry-After (the response must be a refusal)."""
    assert response.status_code == 429, response.status_code
    return int(response["Retry-After"])


def test_failures_from_one_address_lock_that_pair_and_ana_signs_in_from_another(
    people: None, clock: Clock
) -> None:
    for _ in range(5):
        fail("ana", ATTACKER, clock)

    # ana, from an address she never used, signs in at once: the username is not locked.
    assert sign_in("ana", PASSWORD, ANA_ELSEWHERE).status_code == 302
    # From the attacker's address the pair is locked for the cool-off, even with the
    # right password (once the address's own short delay has passed).
    clock.ahead = 2
    locked = sign_in("ana", PASSWORD, ATTACKER)
    assert refused(locked) == PAIR_LOCK_SECONDS - 2
    assert b"from your address" in locked.content
    # A refused attempt checked no password: it is not counted, nor extends the lock.
    assert recorded_failures(username="ana") == 5


def test_the_attackers_address_is_throttled_for_other_usernames_with_a_growing_delay(
    people: None, clock: Clock
) -> None:
    for _ in range(5):
        fail("ana", ATTACKER, clock)

    # Another username from the same address waits, with the right password too.
    throttled = sign_in("bob", PASSWORD, ATTACKER)
    assert refused(throttled) == 1
    assert b"from your address" in throttled.content
    # bob from his own address is not concerned.
    assert sign_in("bob", PASSWORD, ANA_USUAL).status_code == 302
    # Each further failure from the address doubles its wait.
    waits = []
    for attempt, due in enumerate((1, 2, 4, 8)):
        fail(f"guess-{attempt}", ATTACKER, clock, after=due + 0.5)
        waits.append(refused(sign_in("bob", PASSWORD, ATTACKER)))
    assert waits == [2, 4, 8, 16]
    assert recorded_failures(ip_address=ATTACKER) == 9
    # A throttle, not a lock: once the wait is over, bob signs in from there.
    clock.ahead = 16.5
    assert sign_in("bob", PASSWORD, ATTACKER).status_code == 302


def test_a_username_attacked_from_many_addresses_gets_a_short_growing_delay_never_a_lock(
    people: None, clock: Clock
) -> None:
    for index in range(10):
        fail("ana", f"192.0.2.{index}", clock)

    delayed = sign_in("ana", PASSWORD, ANA_ELSEWHERE)
    assert refused(delayed) == 1
    assert b"not locked" in delayed.content
    waits = []
    for index in range(10, 16):
        fail("ana", f"192.0.2.{index}", clock, after=16)
        waits.append(refused(sign_in("ana", PASSWORD, ANA_ELSEWHERE)))
    # 1 s, doubled by each failure, never above AIRLOCK_LOGIN_USERNAME_MAX_DELAY_SECONDS.
    assert waits == [2, 4, 8, 15, 15, 15]
    assert recorded_failures(username="ana") == 16
    # No address of the attack is locked out of other accounts by it (one failure each).
    assert sign_in("bob", PASSWORD, "192.0.2.3").status_code == 302
    # The real ana, a few seconds later, signs in.
    clock.ahead = 15.5
    assert sign_in("ana", PASSWORD, ANA_ELSEWHERE).status_code == 302


def test_ana_signs_in_at_once_from_her_usual_address_while_her_username_is_attacked(
    people: None, clock: Clock
) -> None:
    assert sign_in("ana", PASSWORD, ANA_USUAL).status_code == 302
    for index in range(14):
        fail("ana", f"192.0.2.{index}", clock, after=16)

    assert refused(sign_in("ana", PASSWORD, ANA_ELSEWHERE)) == 15
    # The attacker spends the username's slots; her own address does not wait for them.
    assert sign_in("ana", PASSWORD, ANA_USUAL).status_code == 302


def test_the_admin_sites_sign_in_is_throttled_the_same_way(
    people: None, clock: Clock, settings: Any
) -> None:
    for _ in range(5):
        fail("ana", ATTACKER, clock)

    response = sign_in("bob", PASSWORD, ATTACKER, path="/admin/login/")
    assert refused(response) == 1


@pytest.mark.parametrize(
    ("failures", "seconds"), [(0, 0.0), (4, 0.0), (5, 1.0), (6, 2.0), (9, 16.0), (40, 900.0)]
)
def test_the_delay_doubles_from_the_free_failures_up_to_its_maximum(
    failures: int, seconds: float
) -> None:
    assert login_throttle.delay_seconds(failures, free=5, cap=900) == seconds


def test_the_policy_is_documented() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "login-throttling.md").read_text()
    for name in (
        "AXES_FAILURE_LIMIT",
        "AIRLOCK_LOGIN_CLIENT_FREE_FAILURES",
        "AIRLOCK_LOGIN_CLIENT_MAX_DELAY_SECONDS",
        "AIRLOCK_LOGIN_USERNAME_FREE_FAILURES",
        "AIRLOCK_LOGIN_USERNAME_MAX_DELAY_SECONDS",
        "AIRLOCK_LOGIN_KNOWN_CLIENT_DAYS",
        "Retry-After",
    ):
        assert f"`{name}`" in text, name


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_web_process_throttles_by_address_and_lets_ana_in_from_hers() -> None:
    # The web process of the Procfile (uvicorn, console.asgi: axes' middleware in its async
    # form), one proxy declared so each request names its client address.
    make_person("ana", "operators")
    make_person("bob", "operators")
    server = start_api_server(AIRLOCK_PROXY_COUNT="1")

    def sign_in_over_http(username: str, password: str, address: str) -> httpx.Response:
        headers = {"X-Forwarded-For": address}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
            form = client.get("/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
            assert token is not None, form.text
            return client.post(
                "/login/",
                data={
                    "username": username,
                    "password": password,
                    "csrfmiddlewaretoken": token.group(1),
                },
            )

    try:
        for _ in range(5):
            assert sign_in_over_http("ana", "wrong", ATTACKER).status_code in (200, 429)
        # Real time here: two more failures, each once the address's wait (1 s, then 2 s)
        # is over, leave a 4 s wait — longer than a loaded machine takes for a request.
        for guess, wait in (("x1", 1.5), ("x2", 2.5)):
            time.sleep(wait)
            assert sign_in_over_http(guess, "wrong", ATTACKER).status_code == 200
        throttled = sign_in_over_http("bob", PASSWORD, ATTACKER)
        assert throttled.status_code == 429
        assert 1 <= int(throttled.headers["Retry-After"]) <= 4
        assert "from your address" in throttled.text
        welcomed = sign_in_over_http("ana", PASSWORD, ANA_ELSEWHERE)
        assert welcomed.status_code == 302, welcomed.text
    finally:
        stop_api_server(server)
