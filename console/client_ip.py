"""The client's address as the login lockout sees it, behind a documented proxy.

Without a proxy (`AIRLOCK_PROXY_COUNT=0`, the default) it is `REMOTE_ADDR`:
forwarding headers are ignored, so a client cannot choose its address and
escape a per-address lockout. Behind N trusted proxies, each appends the
address it received the request from to `AIRLOCK_CLIENT_IP_HEADER`
(`X-Forwarded-For` by default), so the client is the N-th entry from the right;
entries further left were written by the client and are never trusted.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest


def _address(value: str) -> str | None:
    value = value.strip()
    if value.startswith("[") and "]" in value:  # [v6]:port
        value = value[1 : value.index("]")]
    elif value.count(":") == 1:  # v4:port
        value = value.split(":", 1)[0]
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


def client_ip(request: HttpRequest) -> str:
    """django-axes' AXES_CLIENT_IP_CALLABLE: the address lockouts are counted against."""
    remote = str(request.META.get("REMOTE_ADDR") or "")
    proxies = settings.AIRLOCK_PROXY_COUNT
    if proxies <= 0:
        return remote
    header = settings.AIRLOCK_CLIENT_IP_HEADER
    hops = [hop for hop in str(request.META.get(header, "")).split(",") if hop.strip()]
    if len(hops) < proxies:
        # The request did not pass every proxy the deployment declares: the
        # peer itself is the best address we know.
        return remote
    return _address(hops[-proxies]) or remote
