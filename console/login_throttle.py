"""Sign-in throttling: a stranger who knows an operator's username cannot keep them out.

Three rules, all counted from django-axes' own failure rows (`AccessAttempt`: one per
username, client address and user agent, with its failures and the time of the last):

1. the pair — a username from one client address — is locked after `AXES_FAILURE_LIMIT`
   failures for `AXES_COOLOFF_TIME` (django-axes itself: AXES_LOCKOUT_PARAMETERS);
2. the client — one address, whatever usernames it tries — is throttled: from its
   `AIRLOCK_LOGIN_CLIENT_FREE_FAILURES`-th failure on, each further sign-in from it waits
   a delay that doubles with every failure (1 s, 2 s, 4 s, …, at most
   `AIRLOCK_LOGIN_CLIENT_MAX_DELAY_SECONDS`) after its last failure;
3. the username alone — failures for it from any address — only ever gets a short delay:
   from its `AIRLOCK_LOGIN_USERNAME_FREE_FAILURES`-th failure on, a sign-in to it waits
   1 s, 2 s, 4 s, … at most `AIRLOCK_LOGIN_USERNAME_MAX_DELAY_SECONDS` after the
   username's last failure — never a lock. An address the person signed in from within
   `AIRLOCK_LOGIN_KNOWN_CLIENT_DAYS` (axes' success log) does not wait for it at all, so
   an attacker spending the username's slots cannot keep its owner out.

A sign-in that must wait is refused before the password is looked at (so it is not a
guess, and it is not counted): `LoginThrottleBackend`, first of AUTHENTICATION_BACKENDS,
covers every form that authenticates (the console's and the admin site's). The answer —
`lockout_response`, django-axes' AXES_LOCKOUT_CALLABLE, also for the pair's lock — is
`429` with `Retry-After` and the wait in words. docs/login-throttling.md is the
operator's version.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from axes.exceptions import AxesBackendPermissionDenied
from axes.handlers.proxy import AxesProxyHandler
from axes.models import AccessAttempt, AccessLog
from django.conf import settings
from django.db.models import Max, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from console.client_ip import client_ip

# The product's clock for the delays (tests move it instead of sleeping).
clock: Callable[[], datetime] = timezone.now

# The first delay; each further failure doubles it, up to the rule's maximum.
BASE_DELAY_SECONDS = 1.0

CLIENT = "client"
USERNAME = "username"
PAIR = "pair"


@dataclass(frozen=True)
class LoginWait:
    """Why a sign-in is refused for now (CLIENT, USERNAME or PAIR), and for how long."""

    reason: str
    seconds: float

    @property
    def retry_after(self) -> int:
        """Whole seconds, at least 1: the Retry-After header."""
        return max(1, math.ceil(self.seconds))


def delay_seconds(failures: int, *, free: int, cap: float) -> float:
    """The wait after the last failure once `failures` reached `free`: 1 s at `free`,
    doubled by each failure after it, never above `cap`; 0 below `free`."""
    if failures < free:
        return 0.0
    return float(min(BASE_DELAY_SECONDS * 2 ** min(failures - free, 32), cap))


def _cooloff() -> timedelta:
    return timedelta(hours=float(settings.AXES_COOLOFF_TIME))


def _failures(now: datetime, **who: str) -> tuple[int, datetime | None]:
    """Failures recorded for `who` (a username or an address) within the cool-off, and
    the time of the last."""
    row = AccessAttempt.objects.filter(attempt_time__gte=now - _cooloff(), **who).aggregate(
        failures=Sum("failures_since_start"), last=Max("attempt_time")
    )
    return int(row["failures"] or 0), row["last"]


def _remaining(now: datetime, last: datetime | None, delay: float) -> float:
    if last is None or delay <= 0:
        return 0.0
    return max(0.0, (last + timedelta(seconds=delay) - now).total_seconds())


def _known_client(username: str, address: str, now: datetime) -> bool:
    """Did `username` sign in from `address` lately (axes' log of successful sign-ins)?"""
    since = now - timedelta(days=int(settings.AIRLOCK_LOGIN_KNOWN_CLIENT_DAYS))
    return bool(
        AccessLog.objects.filter(
            username=username, ip_address=address, attempt_time__gte=since
        ).exists()
    )


def login_wait(*, address: str, username: str) -> LoginWait | None:
    """How long a sign-in as `username` from `address` must still wait (the client's
    throttle first, then the username's delay), or None: it may try now."""
    now = clock()
    failures, last = _failures(now, ip_address=address)
    client_delay = delay_seconds(
        failures,
        free=int(settings.AIRLOCK_LOGIN_CLIENT_FREE_FAILURES),
        cap=float(settings.AIRLOCK_LOGIN_CLIENT_MAX_DELAY_SECONDS),
    )
    wait = _remaining(now, last, client_delay)
    if wait > 0:
        return LoginWait(CLIENT, wait)
    if not username:
        return None
    failures, last = _failures(now, username=username)
    username_delay = delay_seconds(
        failures,
        free=int(settings.AIRLOCK_LOGIN_USERNAME_FREE_FAILURES),
        cap=float(settings.AIRLOCK_LOGIN_USERNAME_MAX_DELAY_SECONDS),
    )
    wait = _remaining(now, last, username_delay)
    if wait > 0 and not _known_client(username, address, now):
        return LoginWait(USERNAME, wait)
    return None


class LoginThrottleBackend:
    """The first authentication backend: refuses a sign-in that must still wait
    (login_wait) before any password is checked. It marks the request as django-axes
    marks a locked-out one, so axes records no failure for it and its middleware answers
    with `lockout_response`. Authenticates nobody itself."""

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> None:
        if request is None:
            return None
        wait = login_wait(address=client_ip(request), username=username or "")
        if wait is None:
            return None
        AxesProxyHandler.update_request(request)
        request.axes_locked_out = True  # type: ignore[attr-defined]
        request.airlock_login_wait = wait  # type: ignore[attr-defined]
        raise AxesBackendPermissionDenied("Sign-in throttled")

    # No get_user: this backend signs nobody in, so no session names it (and Django's
    # force_login, which takes the first backend that has one, passes it by).


def _pair_wait(request: HttpRequest, username: str) -> LoginWait:
    """The time left on the pair's lock (django-axes': the cool-off after its last
    recorded failure; failures during the lock are not recorded)."""
    now = clock()
    _failures_count, last = _failures(now, username=username, ip_address=client_ip(request))
    left = _remaining(now, last, _cooloff().total_seconds())
    return LoginWait(PAIR, left or _cooloff().total_seconds())


def lockout_response(
    request: HttpRequest, original_response: Any = None, credentials: Any = None
) -> HttpResponse:
    """django-axes' AXES_LOCKOUT_CALLABLE: the refused sign-in's page, 429 with
    Retry-After — the client's throttle, the username's delay or the pair's lock."""
    wait: LoginWait | None = getattr(request, "airlock_login_wait", None)
    username = str(request.POST.get(settings.AXES_USERNAME_FORM_FIELD, "") or "")
    if wait is None:
        wait = _pair_wait(request, username)
    context = {
        "reason": wait.reason,
        "retry_after": wait.retry_after,
        "minutes": math.ceil(wait.retry_after / 60),
        "username": username,
    }
    response = render(request, settings.AXES_LOCKOUT_TEMPLATE, context, status=429)
    response["Retry-After"] = str(wait.retry_after)
    return response
