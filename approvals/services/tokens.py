"""API tokens: agent (`ak_`), run (`rt_`) and personal (`pt_`).

A token is `<kind>_<random>`; only its SHA-256 is stored, next to a short
readable prefix used to find candidate rows. The hash comparison is constant
time. Identity comes from the token alone.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.contrib.auth import get_user_model
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connection, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from approvals.models import Agent, AgentToken, PersonalToken, Run
from audit.services import Actor, audit_append
from console.compiled_query import CompiledQuery, Param
from console.permissions import group_names_of, is_admin, remember_groups, require_person
from engine.core.actors import person_id
from engine.core.errors import ValidationFailed

AGENT_PREFIX = "ak_"
RUN_PREFIX = "rt_"
PERSONAL_PREFIX = "pt_"
LOOKUP_PREFIX_LENGTH = 12  # "ak_" + 9 characters of the secret
_LAST_USED_RESOLUTION = timedelta(minutes=1)
_AGENT_NAME = re.compile(r"^[-a-zA-Z0-9_]+\Z")  # Django's slug
_IssuedToken = TypeVar("_IssuedToken", AgentToken, PersonalToken)


@dataclass(frozen=True)
class NewToken:
    secret: str
    prefix: str
    hash: str


@dataclass(frozen=True)
class Principal:
    """Who is calling: an agent, one of an agent's runs, or a person."""

    kind: str  # "agent" | "run" | "person"
    token_prefix: str
    agent: Agent | None = None
    run: Run | None = None
    user: Any = None
    # An agent token's minter (its created_by; None for the command line's): a run it
    # creates records them (runs.run_create), for separation of duties.
    token_minted_by_id: int | None = None

    @property
    def actor(self) -> Actor:
        if self.kind == "run" and self.run is not None:
            return Actor.run(self.run)
        if self.kind == "agent" and self.agent is not None:
            return Actor.agent(self.agent)
        return Actor.person(self.user)

    @property
    def label(self) -> str:
        return self.actor.label


def token_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def token_generate(kind_prefix: str) -> NewToken:
    secret = kind_prefix + secrets.token_urlsafe(32)
    return NewToken(secret=secret, prefix=secret[:LOOKUP_PREFIX_LENGTH], hash=token_digest(secret))


# The personal token's user column, as the lookup's outer query names it.
_PERSONAL_TOKEN_USER = '"{}"."{}"'.format(
    PersonalToken._meta.db_table, PersonalToken._meta.get_field("user").column
)


def live_token(now: datetime | Param) -> Q:
    """A token (agent or personal) neither revoked nor expired at `now`: the one rule for
    authentication and for separation of duties (separation.answers_for_agent). A call
    decision's locking statement spells it in SQL (decision_rows; tests/test_trust_sod.py
    runs both against the same tokens)."""
    return Q(revoked_at__isnull=True) & (Q(expires_at__isnull=True) | Q(expires_at__gt=now))


def _matching(rows: list[Any], digest: str, attr: str = "token_hash") -> Any:
    found = None
    for row in rows:
        # Compare every candidate so timing does not depend on which matched.
        if hmac.compare_digest(getattr(row, attr), digest):
            found = row
    return found


def agent_token_candidates(prefix: str | Param, now: datetime | Param) -> QuerySet[AgentToken]:
    """The agent tokens a bearer token with `prefix` may be at `now`: live, their agent
    active. principal_for_token reads them; the API's read front (approvals/api/fastpoll.py)
    runs this queryset's SQL, compiled once."""
    return AgentToken.objects.filter(live_token(now), prefix=prefix, agent__is_active=True)


def token_needs_touch(last_used_at: datetime | None, now: datetime) -> bool:
    """Whether a use of a token at `now` records itself (`last_used_at`, at most once a
    minute): a read that does not is read-only. The read front hands such a request to Django."""
    return last_used_at is None or now - last_used_at > _LAST_USED_RESOLUTION


# The run and agent token lookups, built and compiled once a process: every API request an
# agent sends runs one, and building them cost more CPU than running them (issue 41).
_RUN_BY_PREFIX = CompiledQuery(
    lambda: Run.objects.select_related("agent").filter(
        token_prefix=Param("prefix", Run._meta.get_field("token_prefix")), agent__is_active=True
    )
)
_AGENT_TOKENS_BY_PREFIX = CompiledQuery(
    lambda: (
        agent_token_candidates(
            Param("prefix", AgentToken._meta.get_field("prefix")),
            Param("now", AgentToken._meta.get_field("expires_at")),
        )
        .select_related("agent")
        .only("id", "token_hash", "last_used_at", "agent", "created_by")
    )
)


def principal_for_token(raw: str) -> Principal | None:
    """Resolve a bearer token to a Principal, or None when unknown, expired or revoked.

    A run token keeps identifying its run after the run ends (writes then
    answer 409 run_not_active), but its agent must still be active.
    """
    if len(raw) < LOOKUP_PREFIX_LENGTH + 8 or len(raw) > 200 or not raw.isascii():
        return None
    now = timezone.now()
    prefix = raw[:LOOKUP_PREFIX_LENGTH]
    digest = token_digest(raw)
    if raw.startswith(AGENT_PREFIX):
        token = _matching(_AGENT_TOKENS_BY_PREFIX.all(prefix=prefix, now=now), digest)
        if token is None:
            return None
        _touch(AgentToken, token.pk, token.last_used_at, now)
        return Principal(
            kind="agent",
            token_prefix=prefix,
            agent=token.agent,
            token_minted_by_id=token.created_by_id,
        )
    if raw.startswith(RUN_PREFIX):
        run = _matching(_RUN_BY_PREFIX.all(prefix=prefix), digest)
        if run is None:
            return None
        return Principal(kind="run", token_prefix=prefix, agent=run.agent, run=run)
    if raw.startswith(PERSONAL_PREFIX):
        token = _matching(_personal_candidates(prefix, now), digest)
        if token is None:
            return None
        _touch(PersonalToken, token.pk, token.last_used_at, now)
        remember_groups(token.user, token.group_names)  # the role checks read no more
        return Principal(kind="person", token_prefix=prefix, user=token.user)
    return None


@dataclass(frozen=True)
class _PersonalCandidate:
    pk: int
    token_hash: str
    last_used_at: datetime | None
    user: Any
    group_names: Any


def _personal_candidates(prefix: str, now: datetime) -> list[_PersonalCandidate]:
    """The live personal tokens with `prefix` whose user is active, each with its user and
    the user's group names. On PostgreSQL one raw statement (the queryset below cost more
    to build than to run: a person's every API call pays it, a decision included); the
    same rule as `live_token` and the queryset."""
    if connection.vendor != "postgresql":
        return [
            _PersonalCandidate(t.pk, t.token_hash, t.last_used_at, t.user, t.group_names)
            for t in PersonalToken.objects.select_related("user")
            .filter(live_token(now), prefix=prefix, user__is_active=True)
            .annotate(group_names=group_names_of(_PERSONAL_TOKEN_USER))
        ]
    user_fields = _user_fields()
    with connection.cursor() as cursor:
        cursor.execute(_personal_lookup_sql(), [prefix, now])
        rows = cursor.fetchall()
    names = [field.attname for field in user_fields]
    return [
        _PersonalCandidate(
            row[0],
            row[1],
            row[2],
            get_user_model().from_db(DEFAULT_DB_ALIAS, names, list(row[3:-1])),
            row[-1],
        )
        for row in rows
    ]


def _user_fields() -> list[Any]:
    return list(get_user_model()._meta.concrete_fields)


@functools.cache
def _personal_lookup_sql() -> str:
    token, user = PersonalToken._meta, get_user_model()._meta
    user_columns = ", ".join(f'u."{field.column}"' for field in _user_fields())
    groups = group_names_of(_PERSONAL_TOKEN_USER).sql
    return (
        f'SELECT "{token.db_table}".id, "{token.db_table}".token_hash, '  # noqa: S608 - model names
        f'"{token.db_table}".last_used_at, {user_columns}, {groups} '
        f'FROM "{token.db_table}" JOIN "{user.db_table}" u '
        f'ON u."{user.pk.column}" = {_PERSONAL_TOKEN_USER} AND u.is_active '
        f'WHERE "{token.db_table}".prefix = %s AND "{token.db_table}".revoked_at IS NULL '
        f'AND ("{token.db_table}".expires_at IS NULL OR "{token.db_table}".expires_at > %s)'
    )


def _touch(model: Any, pk: int, last_used_at: datetime | None, now: datetime) -> None:
    # At most one write per token per minute: the hot read path stays read-only.
    if token_needs_touch(last_used_at, now):
        model.objects.filter(pk=pk).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - _LAST_USED_RESOLUTION)
        ).update(last_used_at=now)


def agent_token_create(
    *,
    agent: Agent,
    actor: Actor,
    label: str = "",
    expires_at: datetime | None = None,
) -> tuple[AgentToken, str]:
    """Issue an agent token (admins, or the system); the secret is returned once
    and never stored. Raises Forbidden.

    A person who mints one is recorded as its creator: while it is live,
    separation of duties treats them like the agent's owner
    (separation.answers_for_agent).
    """
    require_person(actor, is_admin, "Only admins create agent tokens.")
    return _token_issue(
        AgentToken,
        AGENT_PREFIX,
        actor=actor,
        label=label,
        expires_at=expires_at,
        owner={"agent": agent, "created_by_id": person_id(actor)},
        details={"kind": "agent", "agent": agent.name},
    )


def personal_token_create(
    *,
    user: Any,
    actor: Actor,
    label: str = "",
    expires_at: datetime | None = None,
) -> tuple[PersonalToken, str]:
    """Issue a personal token carrying `user`'s permissions.

    Raises Forbidden unless the actor is that (active) person or the system: a token acts
    with its user's roles, so even an admin may not mint one for someone else.
    """
    require_person(
        actor,
        lambda person: person.pk == user.pk,
        "You may only create personal tokens for yourself.",
    )
    return _token_issue(
        PersonalToken,
        PERSONAL_PREFIX,
        actor=actor,
        label=label,
        expires_at=expires_at,
        owner={"user": user},
        details={"kind": "personal", "user": user.get_username()},
    )


def _token_issue(
    model: type[_IssuedToken],
    prefix: str,
    *,
    actor: Actor,
    label: str,
    expires_at: datetime | None,
    owner: dict[str, Any],
    details: dict[str, Any],
) -> tuple[_IssuedToken, str]:
    """Store a new token's hash for `owner` and audit it; the secret is returned once."""
    new = token_generate(prefix)
    with transaction.atomic():
        token = model.objects.create(
            prefix=new.prefix, token_hash=new.hash, label=label, expires_at=expires_at, **owner
        )
        audit_append(
            event_type="token.created",
            actor=actor,
            details={**details, "prefix": new.prefix, "label": label},
        )
    return token, new.secret


def _may_revoke(token: AgentToken | PersonalToken, person: Any) -> bool:
    """A personal token by the person it belongs to; an agent token by an admin."""
    if isinstance(token, PersonalToken):
        return bool(token.user_id == person.pk)
    return is_admin(person)


def token_revoke(*, token: AgentToken | PersonalToken, actor: Actor) -> bool:
    """Revoke a token; returns False when it was already revoked (no second audit row).

    Raises Forbidden unless the actor owns the personal token, or is an admin for
    an agent token (or the system).
    """
    require_person(
        actor, lambda person: _may_revoke(token, person), "You may not revoke this token."
    )
    with transaction.atomic():
        changed = (
            type(token)
            .objects.filter(pk=token.pk, revoked_at__isnull=True)
            .update(revoked_at=timezone.now())
        )
        if changed:
            audit_append(
                event_type="token.revoked",
                actor=actor,
                details={
                    "kind": "agent" if isinstance(token, AgentToken) else "personal",
                    "prefix": token.prefix,
                },
            )
    return bool(changed)


def _agent_fields(*, name: str, owner: str, description: str) -> tuple[str, Any, str]:
    """(name, owner person or None, description), or ValidationFailed listing every
    bad field: the one rule for the Tokens page, the command, the demo and the bench."""
    errors: list[dict[str, str]] = []
    name = (name or "").strip()
    if not _AGENT_NAME.match(name) or len(name) > 100:
        errors.append(
            {
                "field": "name",
                "message": "Use letters, numbers, underscores or hyphens (at most 100).",
            }
        )
    elif Agent.objects.filter(name=name).exists():
        errors.append({"field": "name", "message": f"An agent named {name} already exists."})
    username = (owner or "").strip()
    person = None
    if username:
        person = get_user_model().objects.filter(username=username, is_active=True).first()
        if person is None:
            errors.append({"field": "owner", "message": f"No active person is called {username}."})
    description = description or ""
    if len(description) > 1000:
        errors.append({"field": "description", "message": "At most 1000 characters."})
    if errors:
        raise ValidationFailed(
            "; ".join(f"{e['field']}: {e['message']}" for e in errors), extra={"errors": errors}
        )
    return name, person, description


def agent_create(
    *, name: str, actor: Actor, owner: str = "", description: str = ""
) -> tuple[Agent, str]:
    """Register an agent and issue its first token (both recorded as the actor's).

    `owner` is the username of the accountable person (optional, must be active).
    Admins (or the system) only: raises Forbidden; ValidationFailed for a name
    that is not a slug or is taken, an unknown owner, a long description.
    """
    require_person(actor, is_admin, "Only admins create agents.")
    name, person, description = _agent_fields(name=name, owner=owner, description=description)
    try:
        with transaction.atomic():
            agent = Agent.objects.create(
                name=name, owner=person, description=description, created_by_id=person_id(actor)
            )
            audit_append(
                event_type="agent.created",
                actor=actor,
                details={"agent": name, "owner": person.get_username() if person else None},
            )
            _, secret = agent_token_create(agent=agent, actor=actor, label="initial")
    except IntegrityError as exc:
        # Two admins racing for the same name: the unique constraint decides.
        raise ValidationFailed(
            f"name: An agent named {name} already exists.",
            extra={
                "errors": [{"field": "name", "message": "An agent with this name already exists."}]
            },
        ) from exc
    return agent, secret
