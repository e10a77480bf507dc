"""Adapters for external HTTP targets (a ResourceKind with target=http).

The target is expected to speak conditional HTTP on `<target_url>/<name>`:
`GET` answers the JSON document with a strong, integer `ETag` ("<version>");
writes carry `If-Match` (or `If-None-Match: *` to create), an
`Idempotency-Key` derived from the action id (identical across retries, so a
replay after a lost response returns the stored result instead of applying
twice) and a `Fencing-Token` header the target may use to refuse a zombie
holder. Integer ETags are required because Airlock records versions as
integers (Action.observed_version).

Response mapping (`classify`): 2xx applied; 412 stale (a conflict); 409 a
conflict routed by class; 423 locked (retry with backoff); 429/502/503/504
backoff; other statuses fail. A connect error or connect timeout means the
request was not sent (retry); a read/write timeout means it may have been
applied: the operation becomes `unknown` until an idempotent replay settles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from django.conf import settings

from console.core import jsonsafe
from console.tracing import traced

APPLIED = "applied"
STALE = "stale"
CONFLICT = "conflict"
LOCKED = "locked"
BACKOFF = "backoff"
FAILED = "failed"
NOT_FOUND = "not_found"


def target_timeout_seconds() -> float:
    # Read at each call: tests (and a settings override) change it at run time.
    return float(settings.AIRLOCK_TARGET_TIMEOUT_SECONDS)


class TargetNotSent(Exception):
    """The request never reached the target (connect error/timeout): safe to retry."""


class TargetOutcomeUnknown(Exception):
    """The request may have been applied (timed out after sending)."""


@dataclass(frozen=True)
class TargetResponse:
    status: int
    etag: str | None
    document: Any
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def version(self) -> int | None:
        if not self.etag:
            return None
        raw = self.etag.removeprefix("W/").strip('"')
        return int(raw) if raw.isdigit() else None

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed", "").lower() == "true"

    @property
    def outcome(self) -> str:
        return classify(self.status)


def classify(status: int) -> str:
    if 200 <= status < 300:
        return APPLIED
    if status == 412:
        return STALE
    if status == 409:
        return CONFLICT
    if status == 423:
        return LOCKED
    if status == 404:
        return NOT_FOUND
    if status in (429, 502, 503, 504):
        return BACKOFF
    return FAILED


def idempotency_key_for(action_id: Any) -> str:
    """The same key for every attempt of one action."""
    return f"airlock-action-{action_id}"


class HttpTarget:
    def __init__(self, base_url: str, *, timeout: float | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout if timeout is not None else target_timeout_seconds()

    def url_for(self, name: str) -> str:
        return f"{self.base_url}/{quote(name, safe='')}"

    def _send(
        self, method: str, name: str, *, headers: dict[str, str], body: Any = None
    ) -> TargetResponse:
        content = None if body is None else json.dumps(body).encode()
        try:
            with httpx.Client(timeout=self.timeout) as client:
                response = client.request(
                    method, self.url_for(name), headers=headers, content=content
                )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise TargetNotSent(f"{method} {name}: {type(exc).__name__}") from exc
        except (
            httpx.ReadTimeout,
            httpx.WriteTimeout,
            httpx.RemoteProtocolError,
            httpx.ReadError,
        ) as exc:
            raise TargetOutcomeUnknown(f"{method} {name}: {type(exc).__name__}") from exc
        # The same parser as the API's bodies: a hostile target's NaN, lone
        # surrogate or 10,000-deep document is no document, never a crash or a
        # value PostgreSQL cannot store.
        document = jsonsafe.loads_or_none(response.content) if response.content else None
        return TargetResponse(
            status=response.status_code,
            etag=response.headers.get("etag"),
            document=document,
            headers={k.lower(): v for k, v in response.headers.items()},
        )

    def read(self, name: str) -> TargetResponse:
        """GET the current document and ETag (reads are safe to repeat)."""
        try:
            return self._send("GET", name, headers={"Accept": "application/json"})
        except TargetOutcomeUnknown as exc:
            raise TargetNotSent(str(exc)) from exc

    @traced("airlock.target_call")
    def write(
        self,
        *,
        name: str,
        operation: str,
        payload_format: str,
        payload: Any,
        observed_version: int | None,
        idempotency_key: str,
        fence: int,
    ) -> TargetResponse:
        headers = {
            "Accept": "application/json",
            "Idempotency-Key": idempotency_key,
            "Fencing-Token": str(fence),
        }
        if operation == "create":
            headers["If-None-Match"] = "*"
        else:
            headers["If-Match"] = f'"{observed_version}"'
        if operation == "delete":
            return self._send("DELETE", name, headers=headers)
        if payload_format == "merge_patch":
            headers["Content-Type"] = "application/merge-patch+json"
            return self._send("PATCH", name, headers=headers, body=payload)
        headers["Content-Type"] = "application/json"
        return self._send("PUT", name, headers=headers, body=payload)
