"""Standing grants: "approve and allow similar" (docs/grants.md).

A person approving one per-call write may grant its run (an admin: its agent, across
runs) standing approval for more writes like it — same kind, same operation, a name
starting with a prefix — for a number of uses and a time, both required and capped by
settings, never wider than the run's write set. At proposal a matching live grant admits
the write without a person (`grant_use_for_proposal`: one indexed conditional UPDATE,
asked only when the write's class needs a per-call approval, allows grants and has a
quorum of one). A grant never approves anything retroactively: a write already waiting
for a person keeps waiting; revoking stops every use from the revoke's commit on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import F, Q, QuerySet, Value
from django.db.models.functions import Length, Substr
from django.utils import timezone

from approvals.models import (
    Action,
    Approval,
    ApprovalSubject,
    Grant,
    GrantScope,
    Run,
    RunStatus,
)
from approvals.services.approval_open import approval_details
from approvals.services.write_sets import entries_of
from audit.services import Actor, audit_append
from console.permissions import can_read_everything, is_admin
from engine.core.errors import Forbidden, NotFound, ValidationFailed
from ownership.models import ApprovalMode, ConflictClass

MAX_PREFIX_LENGTH = 255
MAX_REASON_LENGTH = 2000
# Printable text, as the API's TEXT_PATTERN: no control characters in a name prefix.
_PREFIX = re.compile(r"^[^\x00-\x1f\x7f]*$")


@dataclass(frozen=True)
class GrantRequest:
    """What a person asked for with an approval: checked against settings by
    grant_request_checked, against the approval's write by grant_create_locked."""

    uses: int
    ttl_seconds: int
    name_prefix: str
    scope: str = GrantScope.RUN
    reason: str = ""


def _field_error(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(
        f"grant.{field}: {message}",
        extra={"errors": [{"field": f"grant.{field}", "message": message}]},
    )


def _positive_int(raw: dict[str, Any], field: str, high: int) -> int:
    value = raw.get(field)
    if value is None:
        raise _field_error(field, "required")
    if not isinstance(value, int) or isinstance(value, bool):
        raise _field_error(field, "must be an integer")
    low = 60 if field == "ttl_seconds" else 1
    if not low <= value <= high:
        raise _field_error(field, f"must be in [{low}, {high}] (the server's cap)")
    return value


def grant_request_checked(raw: dict[str, Any] | None) -> GrantRequest | None:
    """The decision's `grant` object as a GrantRequest (None: no grant asked), or
    ValidationFailed (422, naming the field) — before anything is locked or written."""
    if raw is None:
        return None
    uses = _positive_int(raw, "uses", settings.AIRLOCK_GRANT_MAX_USES)
    ttl = _positive_int(raw, "ttl_seconds", settings.AIRLOCK_GRANT_MAX_TTL_SECONDS)
    prefix = raw.get("name_prefix")
    if not isinstance(prefix, str):
        raise _field_error("name_prefix", "required (a string; may be empty)")
    if len(prefix) > MAX_PREFIX_LENGTH or not _PREFIX.match(prefix):
        raise _field_error("name_prefix", f"at most {MAX_PREFIX_LENGTH} printable characters")
    scope = raw.get("scope") or GrantScope.RUN
    if scope not in GrantScope.values:
        raise _field_error("scope", "must be run or agent")
    reason = raw.get("reason") or ""
    if not isinstance(reason, str) or len(reason) > MAX_REASON_LENGTH:
        raise _field_error("reason", f"at most {MAX_REASON_LENGTH} characters")
    return GrantRequest(
        uses=uses, ttl_seconds=ttl, name_prefix=prefix, scope=scope, reason=reason.strip()
    )


def _grant_refusal(approval: Approval) -> str | None:
    """Why no grant may come from this approval's decision (None: one may): per-call
    writes only, of a class that allows grants, with a quorum of one."""
    if approval.subject != ApprovalSubject.ACTION or approval.action is None:
        return "Grants come from per-call approvals of single writes only."
    if approval.action.parent_id is not None:
        return "A conflict resolution's approval cannot grant."
    cls: ConflictClass = approval.action.conflict_class
    if not cls.grants_allowed:
        return f"The conflict class {cls.slug} forbids standing grants."
    if approval.quorum > 1 or cls.quorum > 1:
        return "A grant never satisfies a quorum above one."
    return None


def _covering_entry(run_id: Any, kind: str, operation: str, prefix: str) -> bool:
    """Whether one entry of the run's write set covers every name starting with `prefix`
    for `operation` on `kind`: a prefix entry the grant's prefix starts with."""
    run = Run.objects.only("id", "write_set").get(pk=run_id)
    return any(
        entry.kind == kind
        and entry.is_prefix
        and prefix.startswith(entry.name)
        and operation in entry.operations
        for entry in entries_of(run)
    )


def grant_create_locked(
    *, approval: Approval, person: Any, request: GrantRequest, comment: str, now: datetime
) -> Grant:
    """The grant a person's approval of `approval` (locked, and approved by this same
    decision, in the caller's transaction) asked for; audited `grant.created`.

    Raises Forbidden (403 `forbidden`: the approval cannot grant, or an agent-wide grant
    by someone not an admin; 403 `not_in_write_set`: the prefix is wider than the run's
    write set) and ValidationFailed (422: the prefix does not cover the approved write).
    The caller's transaction then rolls the decision back with it: nothing is written."""
    refusal = _grant_refusal(approval)
    if refusal is not None:
        raise Forbidden(refusal, code="forbidden", extra={"reason": "grant_not_allowed"})
    if request.scope == GrantScope.AGENT and not is_admin(person):
        raise Forbidden(
            "Only admins grant an agent across runs; grant this run instead.", code="forbidden"
        )
    action = approval.action
    assert action is not None
    if not action.name.startswith(request.name_prefix):
        raise _field_error(
            "name_prefix", f"must be a prefix of the approved write's name {action.name!r}"
        )
    if not _covering_entry(approval.run_id, action.kind_id, action.operation, request.name_prefix):
        raise Forbidden(
            f"The run's write set does not cover {action.operation} on every name of "
            f"{action.kind_id}/{request.name_prefix}*: a grant is never wider than it.",
            code="not_in_write_set",
            extra={
                "resource": f"{action.kind_id}/{request.name_prefix}*",
                "operation": action.operation,
            },
        )
    run_scoped = request.scope == GrantScope.RUN
    grant = Grant.objects.create(
        kind_id=action.kind_id,
        operation=action.operation,
        name_prefix=request.name_prefix,
        scope=request.scope,
        run_id=approval.run_id if run_scoped else None,
        agent_id=action.agent_id,
        owner=person,
        reason=request.reason or comment,
        approval=approval,
        uses=request.uses,
        expires_at=now + timedelta(seconds=request.ttl_seconds),
    )
    audit_append(
        event_type="grant.created",
        actor=Actor.person(person),
        resource=f"{grant.kind_id}/{grant.name_prefix}*",
        run_id=approval.run_id,
        action_id=approval.action_id,
        details=approval_details(approval, **_grant_audit_details(grant)),
    )
    return grant


def _grant_audit_details(grant: Grant) -> dict[str, Any]:
    return {
        "grant": grant.pk,
        "scope": grant.scope,
        "kind": grant.kind_id,
        "operation": grant.operation,
        "name_prefix": grant.name_prefix,
        "uses": grant.uses,
        "expires_at": grant.expires_at.isoformat(),
        "reason": grant.reason,
    }


# --- At proposal --------------------------------------------------------------


def grants_may_admit(conflict_class: ConflictClass) -> bool:
    """Whether a write of this class may be admitted by a grant at all (no query):
    it needs a per-call approval, its class allows grants, and a quorum of one."""
    return (
        conflict_class.approval_mode == ApprovalMode.PER_CALL
        and conflict_class.grants_allowed
        and conflict_class.quorum == 1
    )


@cache
def _use_sql() -> str:
    table = Grant._meta.db_table
    users = get_user_model()._meta.db_table
    # One statement: the live grant that matches (the partial index grant_live finds the
    # kind's and operation's live grants), counted if it still has a use. The outer WHERE
    # repeats the conditions: a concurrent use or revoke that committed while this waited
    # for the row is re-checked on the row's new version (READ COMMITTED's re-check), so
    # never more than `uses` admissions and none after a revoke. A run-scoped grant admits
    # its own run's writes only; an agent-wide one any run of the agent, except a run whose
    # token its owner minted (separation of duties: the minter never approves that run).
    # Its owner must still be an active person.
    live = "revoked_at IS NULL AND used < uses AND expires_at > %(now)s"
    return (
        f'UPDATE "{table}" g SET used = g.used + 1 '  # noqa: S608 - names from the models' metadata
        f'WHERE g.id = (SELECT c.id FROM "{table}" c '
        f"WHERE c.kind_id = %(kind)s AND c.operation = %(operation)s AND c.{live} "
        "AND starts_with(%(name)s, c.name_prefix) "
        "AND (c.run_id = %(run)s OR (c.run_id IS NULL AND c.agent_id = %(agent)s "
        "AND c.owner_id IS DISTINCT FROM %(minter)s)) "
        f'AND EXISTS (SELECT FROM "{users}" u WHERE u.id = c.owner_id AND u.is_active) '
        "ORDER BY c.expires_at, c.id LIMIT 1) "
        f"AND g.{live} "
        "RETURNING g.id, g.owner_id, g.uses - g.used"
    )


@dataclass(frozen=True)
class GrantUse:
    grant_id: int
    owner_id: int | None
    uses_left: int


def grant_use_for_proposal(
    *, run: Run, kind: str, name: str, operation: str, now: datetime
) -> GrantUse | None:
    """Take one use of a live grant matching this write, in the proposal's transaction
    (the row stays locked until it commits: a revoke waits for it, then stops the next
    one). None when no grant admits it: the write waits for a person. On the embedded
    SQLite database (`make run`'s default), the same rule in two statements
    (`_grant_use_portable`)."""
    if connection.vendor != "postgresql":
        return _grant_use_portable(run=run, kind=kind, name=name, operation=operation, now=now)
    with connection.cursor() as cursor:
        cursor.execute(
            _use_sql(),
            {
                "kind": kind,
                "operation": operation,
                "name": name,
                "run": run.pk,
                "agent": run.agent_id,
                "minter": run.token_minted_by_id,
                "now": now,
            },
        )
        row = cursor.fetchone()
    if row is None:
        return None
    return GrantUse(grant_id=int(row[0]), owner_id=row[1], uses_left=int(row[2]))


def _grant_use_portable(
    *, run: Run, kind: str, name: str, operation: str, now: datetime
) -> GrantUse | None:
    """`_use_sql`'s rule through the ORM, for databases without it (SQLite): the matching
    live grant, then its use counted by a conditional UPDATE that repeats the liveness
    conditions. SQLite runs one writing transaction at a time (console/settings.py opens
    each IMMEDIATE: the write lock from its start), so the two statements cannot interleave
    with another proposal's; the conditional UPDATE still refuses a grant that ran out."""
    live = Q(revoked_at__isnull=True, used__lt=F("uses"), expires_at__gt=now)
    whose = Q(run_id=run.pk) | Q(run__isnull=True, agent_id=run.agent_id)
    if run.token_minted_by_id is not None:
        # Separation of duties: the minter's agent-wide grant never admits that run.
        whose &= ~Q(run__isnull=True, owner_id=run.token_minted_by_id)
    candidates = (
        Grant.objects.filter(live, whose, kind_id=kind, operation=operation)
        .filter(owner__is_active=True)
        .annotate(head=Substr(Value(name), 1, Length("name_prefix")))
        .filter(head=F("name_prefix"))
        .order_by("expires_at", "id")
        .values_list("id", "owner_id")
    )
    for grant_id, owner_id in candidates[:1]:
        counted = Grant.objects.filter(live, pk=grant_id).update(used=F("used") + 1)
        if counted:
            left = Grant.objects.values_list("uses", "used").get(pk=grant_id)
            return GrantUse(grant_id=grant_id, owner_id=owner_id, uses_left=left[0] - left[1])
    return None


# --- Reading and revoking ----------------------------------------------------------


def grants_visible_to(user: Any) -> QuerySet[Grant]:
    """Operators, admins and auditors see every grant; anyone else their own."""
    grants = Grant.objects.select_related("owner", "revoked_by", "agent", "run")
    if can_read_everything(user):
        return grants
    return grants.filter(owner_id=user.pk)


def grant_get_for_person(user: Any, grant_id: int) -> Grant:
    grant = grants_visible_to(user).filter(pk=grant_id).first()
    if grant is None:
        raise NotFound(f"Grant {grant_id} not found.")
    return grant


def _grant_state(grant: Grant, *, now: datetime | None = None) -> str:
    """live, revoked, expired, spent, or run_ended (a run-scoped grant whose run is over)."""
    now = now or timezone.now()
    if grant.revoked_at is not None:
        return "revoked"
    if grant.used >= grant.uses:
        return "spent"
    if grant.expires_at <= now:
        return "expired"
    run = grant.run
    if run is not None and (run.status != RunStatus.ACTIVE or run.expires_at <= now):
        return "run_ended"
    return "live"


def grant_revoke(*, grant_id: int, person: Any) -> Grant:
    """Revoke a grant (its owner or an admin; others: 403, or 404 if they cannot see it).
    From its commit no write is admitted by it (grant_use_for_proposal re-checks). Again:
    a no-op, answered with the grant as revoked."""
    grant = grant_get_for_person(person, grant_id)
    if not (is_admin(person) or grant.owner_id == person.pk):
        raise Forbidden("Only the grant's owner or an admin revokes it.", code="forbidden")
    now = timezone.now()
    with transaction.atomic():
        revoked = Grant.objects.filter(pk=grant_id, revoked_at__isnull=True).update(
            revoked_at=now, revoked_by=person
        )
        if revoked:
            audit_append(
                event_type="grant.revoked",
                actor=Actor.person(person),
                resource=f"{grant.kind_id}/{grant.name_prefix}*",
                run_id=grant.run_id,
                details={"grant": grant.pk, "used": _used_now(grant.pk)},
            )
    return grant_get_for_person(person, grant_id)


def _used_now(grant_id: int) -> int:
    return int(Grant.objects.values_list("used", flat=True).get(pk=grant_id))


def grant_as_dict(grant: Grant, *, now: datetime | None = None) -> dict[str, Any]:
    now = now or timezone.now()
    return {
        "id": grant.pk,
        "kind": grant.kind_id,
        "operation": grant.operation,
        "name_prefix": grant.name_prefix,
        "scope": grant.scope,
        "run": str(grant.run_id) if grant.run_id else None,
        "agent": grant.agent.name,
        "owner": grant.owner.get_username() if grant.owner else None,
        "reason": grant.reason,
        "approval": str(grant.approval_id) if grant.approval_id else None,
        "uses": grant.uses,
        "used": grant.used,
        "uses_left": grant.uses_left,
        "created_at": grant.created_at.isoformat(),
        "expires_at": grant.expires_at.isoformat(),
        "seconds_left": max(int((grant.expires_at - now).total_seconds()), 0),
        "revoked_at": grant.revoked_at.isoformat() if grant.revoked_at else None,
        "revoked_by": grant.revoked_by.get_username() if grant.revoked_by else None,
        "state": _grant_state(grant, now=now),
    }


def grants_saved_since(since: datetime) -> int:
    """Writes that a grant admitted without a person's decision since `since` (the
    dashboard's "decisions saved"; the partial index action_granted)."""
    return Action.objects.filter(grant__isnull=False, created_at__gte=since).count()
