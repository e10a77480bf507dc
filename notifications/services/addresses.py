"""Where a webhook may go (SSRF guard), checked when a subscription is saved and again
at every delivery.

A URL is `https` (or `http` when AIRLOCK_WEBHOOK_ALLOW_HTTP is on); its host is resolved
once, and every address it resolves to must be globally routable — loopback, private,
link-local, shared (CGNAT), multicast, reserved and cloud-metadata addresses are refused —
unless the host, or a range holding the address, is in AIRLOCK_WEBHOOK_ALLOW_HOSTS. The
delivery then connects to the very address that was checked (`CheckedUrl.address`), with
the Host header and TLS server name of the URL: a DNS answer that changes between the check
and the connection (rebinding) cannot move it.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

from engine.core.errors import ValidationFailed

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Metadata services that are not already link-local: Alibaba's, and AWS's IPv6 one
# (inside fc00::/7, refused as private anyway; named so the reason says what it is).
_METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")
)
_SHARED = ipaddress.ip_network("100.64.0.0/10")


class UrlRefused(ValidationFailed):
    """The webhook URL may not be used: a 422 `validation_error` naming the `url` field at
    the API; the delivery fails for good."""

    def __init__(self, message: str) -> None:
        super().__init__(message, extra={"errors": [{"field": "url", "message": message}]})


@dataclass(frozen=True)
class CheckedUrl:
    """A webhook URL whose host resolved to `address`, an allowed one."""

    scheme: str
    host: str
    port: int
    target: str  # path and query, "/" at least
    address: str

    @property
    def connect_url(self) -> str:
        """The URL with the checked address in place of the host name."""
        literal = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.scheme}://{literal}:{self.port}{self.target}"

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


def _address_refusal(address: IPAddress) -> str:
    """Why a webhook may not connect to `address` ("" when it may)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return _address_refusal(address.ipv4_mapped)
    if address in _METADATA:
        return "a cloud metadata address"
    checks = (
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address.is_unspecified, "an unspecified address"),
        (address in _SHARED, "a shared (carrier-grade NAT) address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private address"),
        (not address.is_global, "not a public address"),
    )
    return next((reason for refused, reason in checks if refused), "")


def _allow_list() -> tuple[frozenset[str], tuple[IPNetwork, ...]]:
    names: set[str] = set()
    networks: list[IPNetwork] = []
    for entry in settings.AIRLOCK_WEBHOOK_ALLOW_HOSTS:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            names.add(entry.strip().lower().rstrip("."))
    return frozenset(names), tuple(networks)


def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UrlRefused(f"The webhook host {host!r} does not resolve.") from exc
    found: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    if not found:
        raise UrlRefused(f"The webhook host {host!r} does not resolve.")
    return found


def webhook_url_check(url: str) -> CheckedUrl:
    """Parse, resolve once and check a webhook URL. Raises UrlRefused (the reason names
    the host and the kind of address, never the path or query, which may hold tokens)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise UrlRefused("The webhook URL is not a valid URL.") from exc
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower().rstrip(".")
    allowed_schemes = ("https", "http") if settings.AIRLOCK_WEBHOOK_ALLOW_HTTP else ("https",)
    if scheme not in allowed_schemes:
        raise UrlRefused(f"A webhook URL must be {' or '.join(allowed_schemes)}.")
    if not host:
        raise UrlRefused("The webhook URL has no host.")
    if parts.username or parts.password:
        raise UrlRefused("A webhook URL may not carry a user name or password.")
    port = port or (443 if scheme == "https" else 80)
    names, networks = _allow_list()
    addresses = _resolve(host, port)
    for address in addresses:
        if host in names or any(address in network for network in networks):
            continue
        reason = _address_refusal(address)
        if reason:
            raise UrlRefused(
                f"The webhook host {host!r} resolves to {address}, {reason}; list it in "
                "AIRLOCK_WEBHOOK_ALLOW_HOSTS to allow it."
            )
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return CheckedUrl(scheme, host, port, target, str(addresses[0]))


def url_display(url: str) -> str:
    """What may be shown of a URL: its scheme and host (and port), never its path, query
    or credentials ("" for no URL)."""
    if not url.strip():
        return ""
    try:
        parts = urlsplit(url.strip())
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(invalid URL)"
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{port}/…" if host else f"{parts.scheme}://…"
