"""The rows of a call approval's decision, in as few PostgreSQL statements as the rules allow.

A person's decision of an action's approval is most of the approval round trip (issue 11);
the ORM spent more time building its statements than PostgreSQL spent running them. This
module holds the decision's three statements of its own, in raw SQL built once from the
models' metadata:

- `lock_call_approval`: the approval's subject peeked, then run (FOR SHARE), action (FOR
  UPDATE) and approval (FOR UPDATE) locked in the project's one lock order — each lock
  waits for the one before it, as each CTE's row filter needs the previous CTE's row —
  and returned with everything deciding and answering read: the run's agent, the action's
  conflict class, whether the person minted a live token of the agent and who minted the
  token that created the run (separation of duties, approvals/services/separation.py),
  and the resource the answer's diff is taken against;
- `_vote_settle_call`: the votes so far, this person's vote and what it does, one statement
  (after the lock and the checks: a vote that committed while we waited for the approval is
  seen) — a rejection, or the approval that reaches quorum, decides the approval and moves
  its action out of `pending_approval` (the same conditional UPDATE as
  action_status.action_transition); a vote below quorum moves the action's revision.

PostgreSQL only; on SQLite (the embedded default) decisions.py takes the ORM path (and
`vote_cast`'s ORM statements).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from django.db import connection
from django.db.models import Model

from approvals.models import (
    Action,
    ActionStatus,
    Agent,
    AgentToken,
    Approval,
    ApprovalDecision,
    ApprovalStatus,
    ApprovalSubject,
    Decision,
    Run,
)
from engine.core.raw_rows import Column, from_row, model_columns, select_list
from ownership.models import ConflictClass, Resource

# What deciding a call reads of the run: its agent and the minter of the token that
# created it (separation of duties), its task (the answer). The rest of the row stays
# unread (deferred).
_RUN_FIELDS = frozenset({"id", "agent_id", "task", "status", "token_minted_by_id"})


@dataclass(frozen=True)
class _Statements:
    approval: tuple[Column, ...]
    run: tuple[Column, ...]
    agent: tuple[Column, ...]
    action: tuple[Column, ...]
    conflict_class: tuple[Column, ...]
    resource: tuple[Column, ...]
    lock_sql: str
    vote_settle_sql: str


@cache
def _statements() -> _Statements:
    approval = model_columns(Approval)
    run = model_columns(Run, _RUN_FIELDS)
    agent = model_columns(Agent)
    action = model_columns(Action)
    conflict_class = model_columns(ConflictClass)
    resource = model_columns(Resource)
    approvals = Approval._meta.db_table
    token = AgentToken._meta
    # tokens.live_token in SQL (not revoked, not expired), for a token this person minted
    # for the agent; tests/test_trust_sod.py runs both against the same tokens.
    live_token = (
        f'EXISTS (SELECT FROM "{token.db_table}" t WHERE t.agent_id = g.id '
        "AND t.created_by_id = %(person)s AND t.revoked_at IS NULL "
        "AND (t.expires_at IS NULL OR t.expires_at > %(now)s))"
    )
    lock_sql = (
        f'WITH peek AS MATERIALIZED (SELECT subject, run_id, action_id FROM "{approvals}" '  # noqa: S608 - names from the models' metadata
        "WHERE id = %(approval)s), "
        f'r AS MATERIALIZED (SELECT {select_list(run, "x")} FROM "{Run._meta.db_table}" x '
        "WHERE x.id = (SELECT run_id FROM peek WHERE subject = %(subject)s) FOR SHARE), "
        f'a AS MATERIALIZED (SELECT {select_list(action, "x")} FROM "{Action._meta.db_table}" x '
        "WHERE x.id = (SELECT action_id FROM peek) AND EXISTS (SELECT FROM r) FOR UPDATE), "
        f'ap AS MATERIALIZED (SELECT {select_list(approval, "x")} FROM "{approvals}" x '
        "WHERE x.id = %(approval)s AND EXISTS (SELECT FROM a) FOR UPDATE) "
        f"SELECT peek.subject, {select_list(approval, 'ap')}, {select_list(run, 'r')}, "
        f"{select_list(agent, 'g')}, {select_list(action, 'a')}, "
        f"{select_list(conflict_class, 'c')}, "
        f"{select_list(resource, 'res')}, {live_token} "
        "FROM peek LEFT JOIN ap ON TRUE LEFT JOIN r ON TRUE LEFT JOIN a ON TRUE "
        f'LEFT JOIN "{Agent._meta.db_table}" g ON g.id = r.agent_id '
        f'LEFT JOIN "{ConflictClass._meta.db_table}" c ON c.slug = a.conflict_class_id '
        f'LEFT JOIN "{Resource._meta.db_table}" res '
        "ON res.kind_id = a.kind_id AND res.name = a.name"
    )
    votes = ApprovalDecision._meta.db_table
    # `tally`: whether this person votes now (no earlier vote of theirs) and the approving
    # votes before; `decisive`: the vote decides (`decisive_at`: how many approving votes
    # before it make it decide; 0 for a rejection). The action's one UPDATE either moves it
    # (decisive, still pending_approval: the approval decided with it) or, below quorum,
    # only its revision (its body shows the votes: a 304 must not hide them).
    vote_settle_sql = (
        f'WITH prior AS (SELECT person_id, decision FROM "{votes}" '  # noqa: S608 - names from the models' metadata
        "WHERE approval_id = %(approval)s::uuid), "
        "tally AS MATERIALIZED (SELECT "
        "NOT EXISTS (SELECT FROM prior WHERE person_id = %(person)s::bigint) AS casting, "
        "(SELECT count(*) FROM prior WHERE decision = %(approve)s::varchar) AS approves), "
        "decisive AS MATERIALIZED (SELECT casting AND approves >= %(decisive_at)s::bigint AS yes "
        "FROM tally), "
        f'cast_vote AS (INSERT INTO "{votes}" '
        "(approval_id, person_id, decision, comment, created_at) "
        "SELECT %(approval)s::uuid, %(person)s::bigint, %(decision)s::varchar, %(comment)s::text, "
        "%(now)s::timestamptz FROM tally WHERE casting), "
        f'settled AS (UPDATE "{approvals}" SET status = %(status)s, decided_at = %(now)s '
        "WHERE id = %(approval)s::uuid AND (SELECT yes FROM decisive)), "
        f'moved AS (UPDATE "{Action._meta.db_table}" x SET '
        "status = CASE WHEN d.yes THEN %(to_status)s ELSE x.status END, "
        "revision = x.revision + 1, updated_at = %(now)s, "
        "error = CASE WHEN d.yes THEN COALESCE(%(error)s::jsonb, x.error) ELSE x.error END "
        "FROM decisive d WHERE x.id = %(action)s::uuid AND (SELECT casting FROM tally) "
        "AND (NOT d.yes OR x.status = %(from_status)s) RETURNING d.yes) "
        "SELECT NOT casting, approves, EXISTS (SELECT FROM moved WHERE yes) FROM tally"
    )
    return _Statements(
        approval,
        run,
        agent,
        action,
        conflict_class,
        resource,
        lock_sql,
        vote_settle_sql,
    )


def _cache(model: type[Model], name: str, instance: Model, related: Model | None) -> None:
    model._meta.get_field(name).set_cached_value(instance, related)  # type: ignore[union-attr]


@dataclass(frozen=True)
class LockedCall:
    """A call approval locked with its run and action (the run's agent and the action's
    conflict class cached on them), whether the deciding person minted a live token of
    the agent, and the resource the action writes as it was (None: no such row)."""

    approval: Approval
    minted_live_token: bool
    resource: Resource | None


def lock_call_approval(
    approval_id: uuid.UUID, *, person_id: int | None, now: datetime
) -> LockedCall | str | None:
    """Lock an action's approval, its action and run (decisions._lock_approval_subject's
    order and modes), in one statement, inside the caller's transaction.

    Returns the LockedCall; the approval's subject when it is not an action's (nothing
    is locked then: the caller takes the general path); None when there is no such
    approval.
    """
    sql = _statements()
    with connection.cursor() as cursor:
        cursor.execute(
            sql.lock_sql,
            {
                "approval": approval_id,
                "subject": ApprovalSubject.ACTION.value,
                "person": person_id,
                "now": now,
            },
        )
        row = cursor.fetchone()
    if row is None:
        return None
    subject = str(row[0])
    if subject != ApprovalSubject.ACTION:
        return subject
    if row[1] is None:
        return None  # gone between the peek and the lock
    at = 1
    loaded: list[Any] = []
    for model, columns in (
        (Approval, sql.approval),
        (Run, sql.run),
        (Agent, sql.agent),
        (Action, sql.action),
        (ConflictClass, sql.conflict_class),
        (Resource, sql.resource),
    ):
        loaded.append(None if row[at] is None else from_row(model, columns, row, at))
        at += len(columns)
    approval, run, agent, action, conflict_class, resource = loaded
    _cache(Run, "agent", run, agent)
    _cache(Action, "conflict_class", action, conflict_class)
    _cache(Approval, "run", approval, run)
    _cache(Approval, "action", approval, action)
    return LockedCall(approval=approval, minted_live_token=bool(row[at]), resource=resource)


def vote_cast(
    approval: Approval, person: Any, vote: tuple[str, str], *, now: datetime, one_statement: bool
) -> tuple[bool, int, bool | None]:
    """This person's earlier vote on the locked `approval` and the approving votes before
    this one (no other vote can land while the approval row is locked), and the vote
    (decision, comment) unless they voted: (voted before, approves before, moved_by_vote);
    a person counts once. `one_statement` (a call, PostgreSQL): what the vote does is
    written by the same statement (_vote_settle_call) and `moved_by_vote` says whether it
    decided the approval and moved its action; else the ORM's read and insert, and None
    (the caller writes what the vote does)."""
    decision, comment = vote
    if one_statement:
        rejects = decision == Decision.REJECT
        cast = _vote_settle_call(
            approval=approval,
            person=person,
            decision=decision,
            comment=comment,
            now=now,
            settles_as=(ApprovalStatus.REJECTED, ActionStatus.REJECTED)
            if rejects
            else (ApprovalStatus.APPROVED, ActionStatus.QUEUED),
            error=rejection_error(person, comment) if rejects else None,
        )
        return cast.voted_before, cast.approves_before, cast.moved
    votes = list(
        ApprovalDecision.objects.filter(approval=approval).values_list("person_id", "decision")
    )
    if any(voter == person.pk for voter, _ in votes):
        return True, 0, None
    ApprovalDecision.objects.create(
        approval=approval, person=person, decision=decision, comment=comment
    )
    return False, [vote for _, vote in votes].count(Decision.APPROVE), None


def rejection_error(person: Any, comment: str) -> dict[str, Any]:
    """The error a rejected action records."""
    return {"code": "rejected", "comment": comment, "by": person.get_username()}


@dataclass(frozen=True)
class CallVote:
    """What _vote_settle_call did: whether the person had voted already (then nothing was
    written), the approving votes before this one, and whether the approval was decided
    and its action moved out of `pending_approval` (False: below quorum, or someone else
    moved the action first)."""

    voted_before: bool
    approves_before: int
    moved: bool


def _vote_settle_call(
    *,
    approval: Approval,
    person: Any,
    decision: str,
    comment: str,
    now: datetime,
    settles_as: tuple[str, str],
    error: dict[str, Any] | None = None,
) -> CallVote:
    """This person's vote on the locked call `approval` (checked: pending, not expired, the
    person may decide it) and, when it decides — a rejection, or the approving vote that
    reaches the quorum — the approval settled as `settles_as` (approval status, action
    status; the action with `error`, if given) in the same statement; below quorum the
    action's revision moves. Inside the caller's transaction; the caller audits the vote
    and what it did, sets the instance's status and wakes the action's waiters."""
    assert approval.action_id is not None
    status, to_status = settles_as
    decisive_at = 0 if decision == Decision.REJECT else max(approval.quorum - 1, 0)
    with connection.cursor() as cursor:
        cursor.execute(
            _statements().vote_settle_sql,
            {
                "approval": approval.pk,
                "person": person.pk,
                "decision": decision,
                "comment": comment,
                "now": now,
                "approve": Decision.APPROVE.value,
                "decisive_at": decisive_at,
                "status": status,
                "to_status": to_status,
                "error": None if error is None else json.dumps(error),
                "action": approval.action_id,
                "from_status": ActionStatus.PENDING_APPROVAL.value,
            },
        )
        row = cursor.fetchone()
    assert row is not None
    return CallVote(voted_before=bool(row[0]), approves_before=int(row[1]), moved=bool(row[2]))
