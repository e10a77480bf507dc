"""Bearer authentication for the API: the token alone says who is calling.

`Bearer(kinds=...)` accepts the listed token kinds. A missing, unknown,
expired or revoked token is 401; a valid token of the wrong kind for the
operation is 403 (the caller is known, the permission is missing).

A run token dies with its run. The token of a run that has ended (rejected,
finished, expired or revoked) is accepted only by the operations declared
with `ended_run=True`: reading that run (`GET /runs/{id}`, `GET /runs`) and an
action of that run (`GET /actions/{id}`), so the agent learns why, and the
writes that accept a run token, which answer `409 run_not_active` ("the token
still identifies the run"). Everywhere else it is `401`, like any dead token.
A run still pending approval is not ended: its token works as before.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest
from ninja.errors import AuthenticationError
from ninja.security import HttpBearer

from approvals.models import Agent, Run, RunStatus
from approvals.services.runs import run_effective_status
from approvals.services.tokens import Principal, principal_for_token
from console.requestctx import log_fields_add
from engine.core.errors import Forbidden

AGENT = "agent"
RUN = "run"
PERSON = "person"

ENDED_RUN_STATUSES = frozenset(
    {RunStatus.REJECTED, RunStatus.FINISHED, RunStatus.EXPIRED, RunStatus.REVOKED}
)

_KIND_NAMES = {
    AGENT: "an agent token (ak_)",
    RUN: "a run token (rt_)",
    PERSON: "a personal token (pt_)",
}


class Bearer(HttpBearer):
    """`Authorization: Bearer <ak_|rt_|pt_ token>`."""

    openapi_bearerFormat = "ak_… | rt_… | pt_…"

    def __init__(self, *kinds: str, ended_run: bool = False, deferred: bool = False) -> None:
        super().__init__()
        self.kinds = frozenset(kinds or (AGENT, RUN, PERSON))
        # Does this operation accept the token of an ended run (see the module doc)?
        self.ended_run = ended_run
        # Deferred (async views only): ninja awaits an auth whose `is_async` is true, so
        # the token is only parsed here and looked up by the view (principal_resolve) in
        # the same thread hop as its first read: one hop per poll instead of two.
        self.is_async = deferred

    def __call__(self, request: HttpRequest) -> Any:
        token = bearer_token(request.headers.get("Authorization", ""))
        if token is None:
            return None
        if self.is_async:
            return _deferred(DeferredToken(self, token))
        return self.authenticate(request, token)

    def authenticate(self, request: HttpRequest, token: str) -> Principal | None:
        principal = principal_for_token(token)
        if principal is None:
            return None
        if principal.kind == RUN and not self.ended_run and run_has_ended(principal):
            return None  # a dead credential here: 401
        if principal.kind not in self.kinds:
            wanted = " or ".join(_KIND_NAMES[k] for k in sorted(self.kinds))
            raise Forbidden(f"This operation needs {wanted}.")
        request.principal = principal  # type: ignore[attr-defined]
        log_fields_add(principal=f"{principal.kind}:{principal.label}")  # never the token
        return principal


def bearer_token(authorization: str) -> str | None:
    """The token of an Authorization header, parsed strictly: exactly "Bearer <token>";
    anything else is simply unauthenticated (None). approvals.api.fastpoll parses with it too."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass(frozen=True)
class DeferredToken:
    """A well-formed bearer token not yet looked up (see Bearer's `deferred`)."""

    bearer: Bearer
    token: str


def _deferred(token: DeferredToken) -> Awaitable[DeferredToken]:
    async def accept() -> DeferredToken:
        return token

    return accept()


def principal_resolve(request: HttpRequest) -> Principal:
    """The caller of a view whose Bearer is deferred: looked up now (sync code), with
    exactly the checks and answers (401, 403) of an ordinary Bearer."""
    auth = request.auth  # type: ignore[attr-defined]
    if isinstance(auth, Principal):
        return auth
    assert isinstance(auth, DeferredToken), "principal_resolve needs a deferred Bearer"
    principal = auth.bearer.authenticate(request, auth.token)
    if principal is None:
        raise AuthenticationError()
    request.auth = principal  # type: ignore[attr-defined]
    return principal


def run_has_ended(principal: Principal) -> bool:
    """Is this a run token whose run is rejected, finished, expired or revoked?"""
    if principal.kind != RUN or principal.run is None:
        return False
    return run_effective_status(principal.run) in ENDED_RUN_STATUSES


def principal_of(request: HttpRequest) -> Principal:
    principal: Principal = request.auth  # type: ignore[attr-defined]
    return principal


def reader_of(principal: Principal) -> Agent | Run | Any:
    """Whom the read selectors filter for: the run, the agent or the person."""
    if principal.kind == RUN and principal.run is not None:
        return principal.run
    if principal.kind == AGENT and principal.agent is not None:
        return principal.agent
    return principal.user


any_token = Bearer(AGENT, RUN, PERSON)
agent_token = Bearer(AGENT)
person_token = Bearer(PERSON)
# Operations that still accept an ended run's token (reads of its own run and
# actions; writes, which answer 409 run_not_active).
any_token_or_ended_run = Bearer(AGENT, RUN, PERSON, ended_run=True)
# The same, looked up by the (async) view itself in its first database hop: the poll.
any_token_or_ended_run_deferred = Bearer(AGENT, RUN, PERSON, ended_run=True, deferred=True)
run_token = Bearer(RUN, ended_run=True)
agent_or_run_token = Bearer(AGENT, RUN, ended_run=True)
run_or_person_token = Bearer(RUN, PERSON, ended_run=True)
