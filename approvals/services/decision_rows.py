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
- `vote_cast`: the votes so far and this person's vote, one statement (after the lock:
  a vote that committed while we waited for the approval is seen);
- `settle_call`: the approval decided and its action leaving `pending_approval` (the same
  conditional UPDATE as action_status.action_transition), one statement.

PostgreSQL only; on SQLite (the embedded default) decisions.py takes the ORM path.
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
    vote_sql: str
    settle_sql: str


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
    vote_sql = (
        f'WITH prior AS (SELECT person_id, decision FROM "{votes}" '  # noqa: S608 - names from the models' metadata
        "WHERE approval_id = %(approval)s::uuid), "
        f'cast_vote AS (INSERT INTO "{votes}" '
        "(approval_id, person_id, decision, comment, created_at) "
        "SELECT %(approval)s::uuid, %(person)s::bigint, %(decision)s::varchar, %(comment)s::text, "
        "%(now)s::timestamptz "
        "WHERE NOT EXISTS (SELECT FROM prior WHERE person_id = %(person)s) RETURNING id) "
        "SELECT EXISTS (SELECT FROM prior WHERE person_id = %(person)s), "
        "(SELECT count(*) FROM prior WHERE decision = %(approve)s), "
        "(SELECT count(*) FROM cast_vote)"
    )
    settle_sql = (
        f'WITH settled AS (UPDATE "{approvals}" SET status = %(status)s, '  # noqa: S608 - names from the models' metadata
        "decided_at = %(now)s WHERE id = %(approval)s) "
        f'UPDATE "{Action._meta.db_table}" SET status = %(to_status)s, '
        "revision = revision + 1, updated_at = %(now)s, "
        "error = COALESCE(%(error)s::jsonb, error) "
        "WHERE id = %(action)s AND status = %(from_status)s"
    )
    return _Statements(
        approval,
        run,
        agent,
        action,
        conflict_class,
        resource,
        lock_sql,
        vote_sql,
        settle_sql,
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
    *,
    approval: Approval,
    person: Any,
    decision: str,
    comment: str,
    now: datetime,
    one_statement: bool,
) -> tuple[bool, int]:
    """This person's vote on the locked `approval`, unless they voted already: (already
    voted, approving votes before this one); a person counts once. No other vote can
    land while the approval row is locked. `one_statement` (PostgreSQL): the votes so
    far and the vote in one statement; else one read for both, then the vote."""
    if not one_statement:
        votes = list(
            ApprovalDecision.objects.filter(approval=approval).values_list("person_id", "decision")
        )
        if any(voter == person.pk for voter, _ in votes):
            return True, 0
        ApprovalDecision.objects.create(
            approval=approval, person=person, decision=decision, comment=comment
        )
        return False, [vote for _, vote in votes].count(Decision.APPROVE)
    with connection.cursor() as cursor:
        cursor.execute(
            _statements().vote_sql,
            {
                "approval": approval.pk,
                "person": person.pk,
                "decision": decision,
                "comment": comment,
                "now": now,
                "approve": Decision.APPROVE.value,
            },
        )
        row = cursor.fetchone()
    assert row is not None
    return bool(row[0]), int(row[1])


def settle_call(
    *,
    approval: Approval,
    status: str,
    to_status: str,
    now: datetime,
    error: dict[str, Any] | None = None,
) -> bool:
    """The locked call approval decided (`status`) and its action moved from
    `pending_approval` to `to_status` (with `error`, if given): one statement. Returns
    whether the action moved (False: someone else moved it first). The caller wakes the
    action's waiters (it moved) and sets the instance's status."""
    assert approval.action_id is not None
    with connection.cursor() as cursor:
        cursor.execute(
            _statements().settle_sql,
            {
                "approval": approval.pk,
                "status": status,
                "now": now,
                "to_status": to_status,
                "error": None if error is None else json.dumps(error),
                "action": approval.action_id,
                "from_status": ActionStatus.PENDING_APPROVAL.value,
            },
        )
        return bool(cursor.rowcount > 0)
