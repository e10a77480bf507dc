"""Separation of duties: who answers for an agent, and so may not approve what it asks
where a class forbids the agent's owner approval (approvals, plans, conflict resolutions).

The rule is read in three places that must agree: approval_decide (decisions.py), whose
call path reads the live-token fact in its locking statement (decision_rows.py); the
console inbox, which offers no decision where it would be refused
(approvals_forbidding_self); and a conflict's resolution (ownership/services/resolution.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.utils import timezone

from approvals.models import Agent, AgentToken, Approval, ApprovalSubject, Run
from approvals.services.plans import plan_forbids_owner_approval
from approvals.services.run_policy import classes_for_write_set
from approvals.services.tokens import live_token
from audit.services import Actor
from console.permissions import can_decide_approvals
from engine.core.actors import person_id
from engine.core.errors import Forbidden


def answers_for_agent(
    *,
    agent: Agent,
    actor: Actor,
    run: Run | None = None,
    minted_live_token: bool | None = None,
) -> bool:
    """Whether separation of duties treats `actor` as the agent's owner (only a
    person ever does), for the agent's `run` when one is at stake.

    The recorded owner and the person who created the agent; the person who minted
    the agent token that created `run` (`Run.token_minted_by`, recorded at its
    creation) — for good: revoking that token or its expiry does not make them a
    second pair of eyes on what it started; and whoever minted one of the agent's
    live tokens (not revoked, not expired), who could act as the agent now.
    `minted_live_token`: that last fact when the caller read it already (a call
    decision's locking statement, decision_rows.lock_call_approval — the same rule).
    """
    user_id = person_id(actor)
    if user_id is None:
        return False
    if user_id in (agent.owner_id, agent.created_by_id):
        return True
    if run is not None and run.token_minted_by_id == user_id:
        return True
    if minted_live_token is not None:
        return minted_live_token
    live = live_token(timezone.now())
    return AgentToken.objects.filter(live, agent_id=agent.pk, created_by_id=user_id).exists()


def _owner_approval_forbidden(approval: Approval) -> bool:
    """Whether the approval's class keeps the agent's owner (answers_for_agent) out."""
    if approval.subject == ApprovalSubject.ACTION:
        assert approval.action is not None
        return bool(approval.action.conflict_class.forbid_agent_owner_approval)
    if approval.subject == ApprovalSubject.PLAN:
        assert approval.plan is not None
        return plan_forbids_owner_approval(approval.plan)
    classes = classes_for_write_set(approval.run.write_set or [])
    # No known class: stay on the safe side and keep the owner out.
    return not classes or any(c.forbid_agent_owner_approval for c in classes)


def approvals_forbidding_self(*, approvals: list[Approval], actor: Actor) -> set[uuid.UUID]:
    """The ids of those `approvals` (their run and agent loaded) that separation of
    duties keeps `actor` out of deciding — approval_decide's `self_approval` refusal,
    asked ahead so the console offers no decision there. One read of the agents the
    person minted live tokens for; a class rule is read only for an approval whose
    agent the person answers for, so a page costs nothing more for everyone else."""
    user_id = person_id(actor)
    if user_id is None or not approvals:
        return set()
    live_for = set(
        AgentToken.objects.filter(
            live_token(timezone.now()),
            created_by_id=user_id,
            agent_id__in={approval.run.agent_id for approval in approvals},
        ).values_list("agent_id", flat=True)
    )
    return {
        approval.pk
        for approval in approvals
        if answers_for_agent(
            agent=approval.run.agent,
            actor=actor,
            run=approval.run,
            minted_live_token=approval.run.agent_id in live_for,
        )
        and _owner_approval_forbidden(approval)
    }


def check_separation_of_duties(
    *, approval: Approval, person: Any, minted_live_token: bool | None = None
) -> None:
    """Only people decide; the agent's owner (see answers_for_agent) may not where a
    class forbids it. `person` is None for anyone but an active person."""
    if person is None:
        raise Forbidden("Only an active person can decide approvals.", code="forbidden")
    if not can_decide_approvals(person):
        raise Forbidden("Deciding approvals needs the operator role.", code="forbidden")
    run = approval.run
    if _owner_approval_forbidden(approval) and answers_for_agent(
        agent=run.agent,
        actor=Actor.person(person),
        run=run,
        minted_live_token=minted_live_token,
    ):
        raise Forbidden(
            "You own or created this agent, or minted the token that started this run or "
            "a live token of the agent; its conflict class requires someone else to approve.",
            code="self_approval",
        )
