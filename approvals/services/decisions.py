"""Approvals and decisions. Owner: engine helper. Interface contract:

approval_open_for_run(*, run: Run) -> Approval
    Inside the caller's transaction: a pending run approval (quorum 1, TTL from settings).
approval_open_for_action(*, action: Action) -> Approval
    Inside the caller's transaction: a pending per-call approval bound to
    action.observed_version, quorum/ttl/escalation from the action's class.
approval_decide(*, approval_id, person: User, decision: "approve"|"reject", comment: str) -> Approval
    Checks role and separation of duties (raises Forbidden code="forbidden"/"self_approval"),
    409 InvalidTransition if already decided or expired; counts one vote per person;
    at quorum: run -> runs.run_activate(...), action -> queued + enqueue on commit;
    reject -> run rejected / action rejected with the comment. Audited.
"""

from __future__ import annotations
