"""Bearer authentication for the API: the token alone says who is calling.

`Bearer(kinds=...)` accepts the listed token kinds. A missing, unknown,
expired or revoked token is 401; a valid token of the wrong kind for the
operation is 403 (the caller is known, the permission is missing).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer

from approvals.services.tokens import Principal, principal_for_token
from console.core.errors import Forbidden

AGENT = "agent"
RUN = "run"
PERSON = "person"

_KIND_NAMES = {
    AGENT: "an agent token (ak_)",
    RUN: "a run token (rt_)",
    PERSON: "a personal token (pt_)",
}


class Bearer(HttpBearer):
    """`Authorization: Bearer <ak_|rt_|pt_ token>`."""

    openapi_bearerFormat = "ak_… | rt_… | pt_…"

    def __init__(self, *kinds: str) -> None:
        super().__init__()
        self.kinds = frozenset(kinds or (AGENT, RUN, PERSON))

    def __call__(self, request: HttpRequest) -> Any:
        # Parse strictly: exactly "Bearer <token>", anything else is simply unauthenticated.
        value = request.headers.get("Authorization", "")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.authenticate(request, token.strip())

    def authenticate(self, request: HttpRequest, token: str) -> Principal | None:
        principal = principal_for_token(token)
        if principal is None:
            return None
        if principal.kind not in self.kinds:
            wanted = " or ".join(_KIND_NAMES[k] for k in sorted(self.kinds))
            raise Forbidden(f"This operation needs {wanted}.")
        request.principal = principal  # type: ignore[attr-defined]
        return principal


def principal_of(request: HttpRequest) -> Principal:
    principal: Principal = request.auth  # type: ignore[attr-defined]
    return principal


any_token = Bearer(AGENT, RUN, PERSON)
agent_token = Bearer(AGENT)
run_token = Bearer(RUN)
agent_or_run_token = Bearer(AGENT, RUN)
person_token = Bearer(PERSON)
run_or_person_token = Bearer(RUN, PERSON)
