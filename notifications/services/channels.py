"""Sending one notification through one channel: a signed webhook (Standard Webhooks), an
Apprise URL (chat and paging), or email through Django's backend. No database here: each
function returns what happened (`Sent`), the delivery service records it.

Nothing sent or logged here carries a secret: errors name the host at most.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

import apprise
import httpx
from apprise.manager_plugins import NotificationManager
from django.conf import settings
from django.core.mail import EmailMessage, get_connection
from django.utils import timezone
from standardwebhooks.webhooks import Webhook

from engine.targets.tls import default_trust
from notifications.services.addresses import UrlRefused, webhook_url_check

log = logging.getLogger("airlock.notifications")
# Apprise logs what it sends to, which can include a URL's tokens.
logging.getLogger("apprise").setLevel(logging.CRITICAL)

EXCERPT_CHARS = 1000
USER_AGENT = "Airlock-Webhooks/1"
# Apprise's own generic HTTP targets would reach any address without the webhook guard (a
# plain HTTP endpoint is a webhook subscription); syslog:// writes on the worker's host.
APPRISE_REFUSED_SCHEMES = frozenset({"json", "jsons", "xml", "xmls", "form", "forms", "syslog"})


def _apprise_schemes() -> frozenset[str]:
    """Every scheme Apprise knows, in lower case (and https, which a few of its services' own
    URLs use): only these are ever repeated in an error or shown."""
    known = NotificationManager().schemas()  # type: ignore[no-untyped-call]  # unannotated
    return frozenset({"http", "https", *(str(scheme).lower() for scheme in known)})


_APPRISE_SCHEMES = _apprise_schemes()
# Microsoft Teams is workflows:// (Power Automate): the Apprise installed here (2.3) has no
# msteams:// any more (Microsoft retired the Office 365 connectors it used).
_APPRISE_EXAMPLES = "slack://…, workflows://…, discord://…, mmosts://…, ntfys://…, pagerduty://…"
# A host that is a DNS name (labels of letters, digits and hyphens, a letter TLD): shown.
_DNS_NAME = re.compile(r"^(?=.{1,253}$)(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")


@dataclass(frozen=True)
class Sent:
    """One attempt's outcome. `final`: retrying cannot help (a refused address, an
    unusable URL); `gone`: the endpoint answered 410, disable the subscription."""

    ok: bool
    status_code: int | None = None
    latency_ms: int = 0
    excerpt: str = ""
    error: str = ""
    retry_after: float | None = None
    gone: bool = False
    final: bool = False


def _retry_after(value: str | None) -> float | None:
    """Retry-After as seconds (a number, or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        moment = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (moment - timezone.now()).total_seconds())


def _webhook_signature(
    secrets: list[str], *, webhook_id: str, timestamp: datetime, body: bytes
) -> str:
    """The `webhook-signature` header: one `v1,<base64>` per secret, space-separated (during
    a rotation's overlap both the new and the old secret sign)."""
    return " ".join(
        Webhook(secret).sign(msg_id=webhook_id, timestamp=timestamp, data=body)
        for secret in secrets
    )


def webhook_send(
    *, url: str, secrets: list[str], webhook_id: str, timestamp: datetime, body: bytes
) -> Sent:
    """POST `body` to `url` signed per Standard Webhooks, connecting to the address that
    was checked (webhook_url_check) with the URL's Host and TLS server name; no redirect
    followed, short timeouts, the answer's body read up to EXCERPT_CHARS."""
    try:
        checked = webhook_url_check(url)
    except UrlRefused as exc:
        return Sent(ok=False, error=exc.message[:500], final=True)
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "host": checked.host_header,
        "webhook-id": webhook_id,
        "webhook-timestamp": str(int(timestamp.timestamp())),
        "webhook-signature": _webhook_signature(
            secrets, webhook_id=webhook_id, timestamp=timestamp, body=body
        ),
    }
    extensions: dict[str, Any] = {"sni_hostname": checked.host} if checked.scheme == "https" else {}
    limit = float(settings.AIRLOCK_WEBHOOK_TIMEOUT_SECONDS)
    timeout = httpx.Timeout(limit, connect=min(limit, 3.0))
    started = time.perf_counter()
    try:
        # trust_env off: a proxy from the environment would connect somewhere unchecked.
        with httpx.Client(
            timeout=timeout,
            follow_redirects=False,
            trust_env=False,
            verify=default_trust(trust_env=False),  # what `True` gives, built once a process
        ) as client:
            request = client.build_request(
                "POST", checked.connect_url, content=body, headers=headers, extensions=extensions
            )
            response = client.send(request, stream=True)
            try:
                excerpt = _read_excerpt(response)
            finally:
                response.close()
    except httpx.HTTPError as exc:
        latency = int((time.perf_counter() - started) * 1000)
        return Sent(ok=False, latency_ms=latency, error=f"{type(exc).__name__} from {checked.host}")
    latency = int((time.perf_counter() - started) * 1000)
    code = response.status_code
    return Sent(
        ok=200 <= code < 300,
        status_code=code,
        latency_ms=latency,
        excerpt=excerpt,
        error="" if 200 <= code < 300 else f"HTTP {code}",
        retry_after=_retry_after(response.headers.get("retry-after")),
        gone=code == 410,
    )


def _read_excerpt(response: httpx.Response) -> str:
    received = b""
    for chunk in response.iter_bytes():
        received += chunk
        if len(received) >= EXCERPT_CHARS:
            break
    return received[:EXCERPT_CHARS].decode("utf-8", errors="replace")


def _apprise_scheme(url: str) -> str:
    """The URL's scheme when it is one Apprise knows, else "" (so never a token typed
    where a scheme should be)."""
    scheme = url.strip().split("://", 1)[0].lower() if "://" in url else ""
    return scheme if scheme in _APPRISE_SCHEMES else ""


def _service_schemes(service: Any) -> set[str]:
    schemes: set[str] = set()
    for value in (service.protocol, service.secure_protocol):
        if isinstance(value, str):
            schemes.add(value.lower())
        elif value:
            schemes.update(str(item).lower() for item in value)
    return schemes


def apprise_url_problem(url: str) -> str:
    """Why Apprise cannot use `url` ("" when it can): it must name exactly one service
    Apprise supports and can load here, and not one of its generic HTTP targets (use a
    webhook subscription, which is address-checked). The message never repeats the URL
    (it carries tokens): at most a scheme Apprise knows."""
    scheme = _apprise_scheme(url)
    notifier = apprise.Apprise()
    if not notifier.add(url):
        if scheme in ("", "http", "https"):
            return (
                f"not the URL of a service Apprise supports (such as {_APPRISE_EXAMPLES}); "
                "a plain HTTPS endpoint is a webhook subscription"
            )
        return (
            f"Apprise cannot read this {scheme}:// URL: check it against Apprise's {scheme}:// page"
        )
    if len(notifier) != 1:
        return "one Apprise URL per subscription (this names several services)"
    schemes = _service_schemes(notifier[0])
    if schemes & APPRISE_REFUSED_SCHEMES:
        refused = scheme if scheme in schemes else sorted(schemes & APPRISE_REFUSED_SCHEMES)[0]
        return f"{refused}:// is not a chat or paging service: use a webhook subscription instead"
    return ""


def apprise_url_display(url: str) -> str:
    """What may be shown of an Apprise URL: its scheme, and its host only when that is a
    DNS name (`ntfys://ntfy.example.org/…`). In many services' URLs the host's place holds
    a token (`tgram://<bot token>/…`, `pagerduty://<key>@<key>/`), so anything else is
    left out."""
    scheme = _apprise_scheme(url) or "apprise"
    rest = url.strip().split("://", 1)[1] if "://" in url else ""
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1].split(":", 1)[0].lower()
    return f"{scheme}://{host}/…" if _DNS_NAME.match(host) else f"{scheme}://…"


def apprise_send(*, url: str, title: str, body: str) -> Sent:
    """Send a short text through Apprise (Slack, Teams, Discord, ntfy, PagerDuty, …)."""
    problem = apprise_url_problem(url)
    if problem:
        return Sent(ok=False, error=problem, final=True)
    notifier = apprise.Apprise()
    notifier.add(url)
    started = time.perf_counter()
    try:
        ok = bool(notifier.notify(title=title, body=body))
    except Exception as exc:  # a plugin's bug must not kill the worker's job
        ok, error = False, f"Apprise raised {type(exc).__name__}"
    else:
        error = "" if ok else "Apprise reported a failure"
    latency = int((time.perf_counter() - started) * 1000)
    return Sent(ok=ok, latency_ms=latency, error=error)


def email_send(*, recipients: list[str], subject: str, body: str) -> Sent:
    """One plain-text message per recipient (nobody sees the others' addresses)."""
    if not recipients:
        return Sent(
            ok=False,
            error="the target group has no active member with an email address",
            final=True,  # retrying for a day would not give anyone an address
        )
    started = time.perf_counter()
    messages = [
        EmailMessage(subject=subject, body=body, from_email=None, to=[address])
        for address in recipients
    ]
    try:
        sent = get_connection(fail_silently=False).send_messages(messages) or 0
    except Exception as exc:  # SMTP, DNS, TLS: retried with backoff
        latency = int((time.perf_counter() - started) * 1000)
        return Sent(ok=False, latency_ms=latency, error=f"email: {type(exc).__name__}")
    latency = int((time.perf_counter() - started) * 1000)
    ok = sent == len(messages)
    return Sent(
        ok=ok,
        latency_ms=latency,
        excerpt=f"{sent} of {len(messages)} messages accepted",
        error="" if ok else "the email backend did not accept every message",
    )
