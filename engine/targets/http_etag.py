"""Any HTTP service with strong ETags and conditional requests as a target (httpx).

S3-style object stores, WebDAV servers, REST APIs: `GET <base_url>/<name>` answers the JSON
document and a strong `ETag`; `PUT` with `If-Match: "<tag>"` replaces it, `PUT` with
`If-None-Match: *` creates it, `DELETE` with `If-Match` removes it. The tag is opaque: kept
without its quotes as the version, sent back quoted, compared exactly, never parsed.

A kind's settings (`HttpEtagSettings.from_settings`):

    base_url               http(s)://host[:port]/path — no user:password@, no query
    credentials_env        optional: the environment variable holding the credential
    auth_scheme            "Bearer" (default), "Basic" (the variable holds user:password) or
                           "" (the variable holds the whole header value)
    auth_header            default "Authorization"
    ca_bundle_env          optional, an https base_url only: the environment variable holding
                           the PEM text of the CA bundle to trust instead of the default store
                           (engine/targets/tls.py; verification is never off)
    client_cert_env        optional, an https base_url only: the environment variable holding
                           the PEM text of a client certificate and its unencrypted key, for
                           a service that requires mutual TLS (engine/targets/tls.py)
    honours_idempotency_key  the service replays a repeated Idempotency-Key (default false)
    honours_fencing_token    the service refuses a Fencing-Token lower than one it took
                             (default false); only then are these headers sent at all
    timeout                seconds (default 10)
    readback_seconds       when a write's answer carries no strong tag, how long to keep
                           reading it back for one (default 2; Apache tags a file changed
                           within the last second as weak)

Answers: 2xx applied (the new version from the answer's ETag; when the answer has none, a
read that finds our document gives it); 412 → stale, with the document read again for the
conflict page; 409 → fenced when the service honours our fencing token and the version still
matched, else stale; 404 on an update or delete → stale (gone); 423/429/502/503/504 → locked
(back off, `Retry-After` kept); anything else → failed. A connect error → not sent (a server
certificate that does not verify is one: the handshake stops before the request; so is our
client certificate refused with TLS 1.2); a timeout or a broken answer after sending →
unknown: settle it by reading (`engine.targets.base.settle_by_reading`), never a second
blind attempt. Our client certificate refused with TLS 1.3 is one of those: the server's
alert comes after the client's side of the handshake, once httpx has written the request —
it says so, but it cannot prove the request was not taken.

Weak (`W/`) or missing ETags on a read raise `WeakValidator`: such a service cannot be
governed. The guarantee is only as good as the service's own conditional write: it must
check If-Match and write as one atomic step, and its tag must change on every change.
WsgiDAV's filesystem tags (inode-mtime-size, mtime in whole seconds) do not always change —
a same-size write within the same second keeps the tag (tests/test_targets_http_etag.py
shows it); the adapter marks an applied write whose tag did not move
(`detail="version_did_not_move"`), but it cannot see someone else's.
"""

from __future__ import annotations

import base64
import json
import math
import re
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from engine.targets.base import (
    ABSENT,
    SCRATCH,
    Capabilities,
    Outcome,
    RestoresByVerbs,
    Snapshot,
    TargetConfigError,
    TargetError,
    WeakValidator,
    WriteResult,
    check_env_name,
    quoted,
    read_credentials,
    refuse_unknown_settings,
    scrub,
    strong_version,
)
from engine.targets.tls import (
    certificate_error,
    client_certificate_alert,
    default_trust,
    present_client_certificate,
    refused_certificate,
    refused_client_certificate,
    tls_setting,
    trusted_context,
)

_KNOWN = (
    "base_url",
    "credentials_env",
    "auth_scheme",
    "auth_header",
    "ca_bundle_env",
    "client_cert_env",
    "honours_idempotency_key",
    "honours_fencing_token",
    "timeout",
    "readback_seconds",
)
_BUSY = frozenset({423, 429, 502, 503, 504})
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.LocalProtocolError)
# RFC 9110 field-value: visible ASCII, spaces/tabs inside and obs-text; no CR, LF or NUL.
_HEADER_VALUE = re.compile(r"^[\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?$")
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
VERSION_DID_NOT_MOVE = "version_did_not_move"


def _flag(settings: Mapping[str, Any], name: str) -> bool:
    value = settings.get(name, False)
    if not isinstance(value, bool):
        raise TargetConfigError(f"{name}: true or false")
    return value


@dataclass(frozen=True)
class HttpEtagSettings:
    base_url: str
    credentials_env: str | None = None
    auth_scheme: str = "Bearer"
    auth_header: str = "Authorization"
    ca_bundle_env: str | None = None  # the PEM text of the CA bundle to trust (https only)
    client_cert_env: str | None = None  # a client certificate + its key, PEM (https only)
    honours_idempotency_key: bool = False
    honours_fencing_token: bool = False
    timeout: float = 10.0
    readback_seconds: float = 2.0

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> HttpEtagSettings:
        if not isinstance(settings, Mapping):
            raise TargetConfigError("settings: an object")
        refuse_unknown_settings(settings, _KNOWN)
        base_url = settings.get("base_url")
        if not isinstance(base_url, str):
            raise TargetConfigError("base_url: an http(s) URL")
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TargetConfigError("base_url: an http(s) URL with a host")
        if parts.username or parts.password or "@" in parts.netloc:
            raise TargetConfigError(
                "base_url: no user or password in the URL — name credentials_env instead"
            )
        if parts.query or parts.fragment:
            raise TargetConfigError("base_url: no query or fragment")
        env = settings.get("credentials_env")
        https = parts.scheme == "https"
        tls = {
            name: tls_setting(settings, name, https=https, refusal="only for an https base_url")
            for name in ("ca_bundle_env", "client_cert_env")
        }
        scheme = settings.get("auth_scheme", "Bearer")
        if scheme not in ("Bearer", "Basic", ""):
            raise TargetConfigError('auth_scheme: "Bearer", "Basic" or ""')
        header = settings.get("auth_header", "Authorization")
        if not isinstance(header, str) or not header.replace("-", "").isalnum():
            raise TargetConfigError("auth_header: a header name")
        timeout = settings.get("timeout", 10.0)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= 300
        ):
            raise TargetConfigError("timeout: seconds between 0 and 300")
        readback = settings.get("readback_seconds", 2.0)
        if (
            isinstance(readback, bool)
            or not isinstance(readback, int | float)
            or not 0 <= readback <= 30
        ):
            raise TargetConfigError("readback_seconds: seconds between 0 and 30")
        return cls(
            base_url=base_url.rstrip("/"),
            credentials_env=None if env is None else check_env_name(env),
            auth_scheme=scheme,
            auth_header=header,
            ca_bundle_env=tls["ca_bundle_env"],
            client_cert_env=tls["client_cert_env"],
            honours_idempotency_key=_flag(settings, "honours_idempotency_key"),
            honours_fencing_token=_flag(settings, "honours_fencing_token"),
            timeout=float(timeout),
            readback_seconds=float(readback),
        )


class HttpEtagTarget(RestoresByVerbs):
    def __init__(self, settings: HttpEtagSettings) -> None:
        self.settings = settings

    @property
    def capabilities(self) -> Capabilities:
        s = self.settings
        return Capabilities(
            holds_fence=s.honours_fencing_token, takes_idempotency_key=s.honours_idempotency_key
        )

    def url_for(self, name: str) -> str:
        return f"{self.settings.base_url}/{quote(name, safe='')}"

    def _auth(self) -> tuple[dict[str, str], list[str]]:
        """The auth header (if any) and every form of the secret to scrub."""
        s = self.settings
        if s.credentials_env is None:
            return {}, []
        secret = read_credentials(s.credentials_env)
        if not _HEADER_VALUE.match(secret):
            # Refused here, before httpx: its transport would put the illegal value in an
            # exception that its own DEBUG log prints.
            raise TargetError(
                f"the credential in {s.credentials_env} is not a valid header value "
                "(control characters or line breaks)"
            )
        if s.auth_scheme == "Basic":
            value = "Basic " + base64.b64encode(secret.encode()).decode()
        else:
            value = f"{s.auth_scheme} {secret}".strip()
        forms = [secret, value, value.split(" ", 1)[-1]]
        forms += [repr(f)[1:-1] for f in forms] + [repr(f.encode())[2:-1] for f in forms]
        forms += [piece for piece in secret.replace("\r", "\n").split("\n") if len(piece) >= 4]
        return {s.auth_header: value}, forms

    def _verify(self) -> ssl.SSLContext:
        """httpx's `verify`: its default trust (True), or a context that trusts the kind's
        CA bundle and/or presents its client certificate. TargetError when a variable is
        unset or does not load: nothing can be sent."""
        s = self.settings
        if s.ca_bundle_env is None and s.client_cert_env is None:
            return default_trust()  # what `True` gives, built once a process
        context = (
            httpx.create_ssl_context()  # the default trust, as `verify=True` gives
            if s.ca_bundle_env is None
            else trusted_context(s.ca_bundle_env)
        )
        if s.client_cert_env is not None:
            present_client_certificate(context, s.client_cert_env, SCRATCH)
        return context

    def _transport_said(self, exc: httpx.HTTPError, *, maybe_sent: bool) -> str:
        """A transport error in words: a server certificate that did not verify, our client
        certificate refused (and whether the request may have left), or httpx's text."""
        refused = certificate_error(exc)
        if refused is not None:
            return refused_certificate(refused, self.settings.ca_bundle_env)
        alert = client_certificate_alert(exc)
        if alert is None:
            return f"{type(exc).__name__}: {exc}"
        said = refused_client_certificate(alert, self.settings.client_cert_env)
        if maybe_sent:
            # TLS 1.3: the alert comes after the client's Finished, once the request is
            # written; a server that keeps to the protocol has not read it, but nothing
            # here proves that.
            return f"{said} — after the request was written (TLS 1.3): it may have been taken"
        return f"{said} — in the handshake: nothing was sent"

    def _request(
        self, method: str, name: str, headers: dict[str, str], body: bytes | None = None
    ) -> tuple[httpx.Response | None, Outcome | None, str]:
        """(response, None, "") or (None, NOT_SENT | UNKNOWN, scrubbed detail)."""
        try:
            auth, secrets = self._auth()
            verify = self._verify()
        except TargetError as exc:
            return None, Outcome.NOT_SENT, str(exc)
        outcome: Outcome | None = None
        detail = ""
        try:
            with httpx.Client(timeout=self.settings.timeout, verify=verify) as client:
                response = client.request(
                    method, self.url_for(name), headers={**headers, **auth}, content=body
                )
                response.read()
        except _NOT_SENT as exc:
            said = self._transport_said(exc, maybe_sent=False)
            outcome, detail = Outcome.NOT_SENT, scrub(said, secrets)
        except httpx.HTTPError as exc:
            # A read or write timeout, a read or write error, a broken answer — or anything
            # else (a body that fails to decode, ...) — may come after the target acted:
            # unknown, settled by reading, never retried blind.
            said = self._transport_said(exc, maybe_sent=True)
            outcome, detail = Outcome.UNKNOWN, scrub(said, secrets)
        if outcome is not None:
            return None, outcome, detail
        return response, None, ""

    # -- the interface -------------------------------------------------------------------------

    def read(self, name: str) -> Snapshot:
        response, failed, detail = self._request("GET", name, {"Accept": "application/json"})
        if response is None:
            raise TargetError(f"cannot read {name}: {failed} {detail}")
        if response.status_code in (404, 410):
            return ABSENT
        if response.status_code != 200:
            raise TargetError(f"GET {name} answered {response.status_code}")
        version = strong_version(response.headers.get("etag"))
        if len(response.content) > MAX_DOCUMENT_BYTES:
            raise TargetError(f"{name} is larger than {MAX_DOCUMENT_BYTES} bytes")
        try:
            document = json.loads(response.content, parse_constant=_refuse_constant)
            # What JSON allows but a document store cannot hold: a number that overflows to
            # infinity (1e999), a lone surrogate ("\udfff").
            json.dumps(document, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except (ValueError, RecursionError, UnicodeEncodeError):
            raise TargetError(f"{name} is not a JSON document") from None
        return Snapshot(document, version)

    def _headers(self, *, fence: int, idempotency_key: str) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.settings.honours_idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        if self.settings.honours_fencing_token:
            headers["Fencing-Token"] = str(fence)
        return headers

    def _read_strong(self, name: str) -> Snapshot:
        """`read`, asked again for up to `readback_seconds` while the target's tag is weak
        (Apache tags a file changed within the last second as weak, then as strong)."""
        deadline = time.monotonic() + self.settings.readback_seconds
        while True:
            try:
                return self.read(name)
            except WeakValidator:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _current(self, name: str) -> tuple[Snapshot | None, str]:
        try:
            return self._read_strong(name), ""
        except WeakValidator as exc:
            return None, str(exc)
        except TargetError:
            return None, "could not read the current document"

    def _result(
        self,
        response: httpx.Response,
        *,
        name: str,
        method: str,
        written: Any,
        expected_version: str | None,
    ) -> WriteResult:
        status = response.status_code
        if 200 <= status < 300:
            if method == "DELETE":
                return WriteResult(Outcome.APPLIED, version=None)
            return self._applied(response, name=name, written=written, expected=expected_version)
        if status in _BUSY:
            return WriteResult(
                Outcome.LOCKED,
                detail=f"{method} answered {status}",
                retry_after=_seconds_after(response.headers.get("retry-after")),
            )
        if status in (412, 409) or (status == 404 and expected_version is not None):
            current, note = self._current(name)
            if (
                status == 409
                and self.settings.honours_fencing_token
                and current is not None
                and current.version == expected_version
            ):
                return WriteResult(Outcome.FENCED, current=current, detail=f"{method} answered 409")
            return WriteResult(
                Outcome.STALE, current=current, detail=f"{method} answered {status} {note}".strip()
            )
        return WriteResult(Outcome.FAILED, detail=f"{method} answered {status}")

    def _applied(
        self, response: httpx.Response, *, name: str, written: Any, expected: str | None
    ) -> WriteResult:
        tag = response.headers.get("etag")
        version: str | None = None
        detail = ""
        try:
            version = strong_version(tag)
        except WeakValidator:
            # No strong tag in the answer: read it back (Apache's mod_dav answers a PUT with
            # none, and tags a file modified within the last second as weak).
            version, detail = self._read_back(name, written)
        if version is not None and version == expected:
            detail = VERSION_DID_NOT_MOVE
        return WriteResult(Outcome.APPLIED, version=version, detail=detail)

    def _read_back(self, name: str, written: Any) -> tuple[str | None, str]:
        """The version of our document, read back; None when the target holds another
        document by then or gives no strong tag within `readback_seconds`."""
        try:
            current = self._read_strong(name)
        except WeakValidator:
            return None, "applied; the target gave only a weak tag to read it back by"
        except TargetError:
            return None, "applied; the version could not be read back"
        if current.exists and current.document == written:
            return current.version, ""
        return None, "applied; the target already holds another document"

    @staticmethod
    def _body(document: Any) -> bytes:
        return json.dumps(
            document, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()

    def write(
        self,
        name: str,
        document: Any,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        try:
            body = self._body(document)
            headers = {
                **self._headers(fence=fence, idempotency_key=idempotency_key),
                "If-Match": quoted(expected_version),
                "Content-Type": "application/json",
            }
        except (TargetError, ValueError, TypeError) as exc:
            return WriteResult(Outcome.FAILED, detail=f"not sent: {type(exc).__name__}")
        response, failed, detail = self._request("PUT", name, headers, body)
        if response is None:
            assert failed is not None
            return WriteResult(failed, detail=detail)
        return self._result(
            response, name=name, method="PUT", written=document, expected_version=expected_version
        )

    def create(
        self,
        name: str,
        document: Any,
        *,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        try:
            body = self._body(document)
        except (ValueError, TypeError) as exc:
            return WriteResult(Outcome.FAILED, detail=f"not sent: {type(exc).__name__}")
        headers = {
            **self._headers(fence=fence, idempotency_key=idempotency_key),
            "If-None-Match": "*",
            "Content-Type": "application/json",
        }
        response, failed, detail = self._request("PUT", name, headers, body)
        if response is None:
            assert failed is not None
            return WriteResult(failed, detail=detail)
        return self._result(
            response, name=name, method="PUT", written=document, expected_version=None
        )

    def delete(
        self,
        name: str,
        *,
        expected_version: str,
        fence: int,
        idempotency_key: str,
        message_context: Mapping[str, str] | None = None,
    ) -> WriteResult:
        try:
            headers = {
                **self._headers(fence=fence, idempotency_key=idempotency_key),
                "If-Match": quoted(expected_version),
            }
        except TargetError as exc:
            return WriteResult(Outcome.FAILED, detail=str(exc))
        response, failed, detail = self._request("DELETE", name, headers)
        if response is None:
            assert failed is not None
            return WriteResult(failed, detail=detail)
        return self._result(
            response, name=name, method="DELETE", written=None, expected_version=expected_version
        )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _seconds_after(value: str | None) -> float | None:
    """A Retry-After header as seconds (a number, or an HTTP date from now)."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        moment = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    seconds = moment.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None
