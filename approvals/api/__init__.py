"""API of the approvals app: runs, actions (with long-poll), approvals, undo,
auto-approve rules, standing grants. One module per sub-domain; this router assembles them."""

from __future__ import annotations

from ninja import Router

from approvals.api import actions, decisions, grants, plans, rules, runs

__all__ = ["router"]

router = Router()
for part in (runs, actions, plans, decisions, grants, rules):
    router.add_router("", part.router)
