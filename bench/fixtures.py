"""Seed data, created through the product's own services so every row carries its audit:
the first admin by `manage.py person_create` (the bootstrap verb), then people, resource kinds,
auto-approve rules, agents, runs, tokens and actions by the services the console and the API
call. Resources are created by auto-approved `create` actions applied by the RQ workers.

Runs in the orchestrator process after `django.setup()`.
"""

from __future__ import annotations

import io
import math
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command

from approvals.models import Action, Agent, Approval, Run
from approvals.services.actions import Proposal, action_propose
from approvals.services.preconditions import parse_tag_condition
from approvals.services.rules import auto_approve_rule_create
from approvals.services.runs import run_create
from approvals.services.tokens import agent_create, personal_token_create
from audit.services import Actor
from console.people import person_create
from ownership.models import ResourceKind
from ownership.services.catalog import resource_kind_save

FINAL = {"applied", "conflict", "failed", "rejected", "cancelled", "expired"}
# The product's default write rate limit per token (600/min): a token is used for at most
# this many decisions, so set-up never measures the limiter.
DECISIONS_PER_TOKEN = 500
OWNER_GROUP = "platform"

# kind → (create class, update class): per-run classes apply at once, per-call ones wait for a
# person's decision (the long-poll, round-trip and drain figures need pending approvals).
KINDS = {
    "bench-doc": ("add_unique", "recompute_field"),
    "bench-call": ("add_unique", "replace_shared_document"),
    "bench-wait": ("replace_shared_document", "replace_shared_document"),
    "bench-core": ("add_unique", "recompute_field"),
}


@dataclass(frozen=True)
class RunHandle:
    run_id: uuid.UUID
    token: str


@dataclass(frozen=True)
class Pending:
    action_id: str
    approval_id: str
    etag: str


@dataclass
class World:
    admin: Any
    operator: Any
    agent: Agent
    agent_token: str  # the agent's own token (ak_): the reads measured with both token kinds

    def operator_tokens(self, decisions: int) -> list[str]:
        """Fresh personal tokens, enough for `decisions` within the per-token rate limit."""
        count = max(1, math.ceil(decisions / DECISIONS_PER_TOKEN))
        actor = Actor.person(self.operator)
        return [
            personal_token_create(user=self.operator, actor=actor, label="bench")[1]
            for _ in range(count)
        ]


def bootstrap() -> World:
    """The first admin (no admin exists yet to authorise the service), then everything else
    through the services with that admin as the actor."""
    call_command("person_create", "bench-admin", role=["admin"], stdout=io.StringIO())
    admin = get_user_model().objects.get(username="bench-admin")
    operator = person_create(
        user=admin,
        username="bench-operator",
        password=secrets.token_urlsafe(18),
        roles=["operator"],
        groups=[OWNER_GROUP],
    )
    for slug, (create_class, update_class) in KINDS.items():
        resource_kind_save(
            slug=slug,
            data={
                "description": f"bench: {slug}",
                "classes": {"create": create_class, "update": update_class, "delete": update_class},
                "owner_group": OWNER_GROUP,
            },
            actor=Actor.person(admin),
        )
        auto_approve_rule_create(
            actor=Actor.person(admin),
            kind=slug,
            operations=["create", "update"],
            description="bench",
        )
    agent, secret = agent_create(name="bench-agent", actor=Actor.person(admin))
    return World(admin=admin, operator=operator, agent=agent, agent_token=secret)


def run_for(world: World, patterns: list[str], task: str) -> RunHandle:
    """An auto-approved run over `patterns` (kind/name or kind/prefix*)."""
    write_set = [{"resource": p, "operations": ["create", "update"]} for p in patterns]
    run, token = run_create(
        agent=world.agent,
        task=task,
        write_set=write_set,
        ttl_seconds=4 * 3600,
        actor=Actor.agent(world.agent),
    )
    return RunHandle(run_id=run.pk, token=token)


def propose(
    handle: RunHandle, kind: str, name: str, payload: dict[str, Any], *, if_match: str = ""
) -> Action:
    """One proposal through the API's service: a create when `if_match` is empty."""
    run = Run.objects.select_related("agent").get(pk=handle.run_id)
    proposal = Proposal(
        kind=ResourceKind.objects.get(pk=kind),
        name=name,
        operation="update" if if_match else "create",
        payload_format="merge_patch",
        payload=payload,
        if_match=parse_tag_condition(if_match, header="If-Match") if if_match else None,
        create_if_absent=not if_match,
        idempotency_key=f"bench-{uuid.uuid4().hex}",
        reason="bench",
    )
    return action_propose(run=run, proposal=proposal)


def wait_final(action_ids: list[str], timeout: float) -> int:
    """Wait until every action is final; returns how many are."""
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        done = Action.objects.filter(id__in=action_ids, status__in=FINAL).count()
        if done >= len(action_ids):
            break
        time.sleep(0.05)
    return done


def create_resources(
    handle: RunHandle, kind: str, names: list[str], document: dict[str, Any]
) -> None:
    """Resources through auto-approved creates, applied by the running workers."""
    ids = [str(propose(handle, kind, name, document).pk) for name in names]
    done = wait_final(ids, timeout=60 + len(ids) * 0.2)
    applied = Action.objects.filter(id__in=ids, status="applied").count()
    if done < len(ids) or applied < len(ids):
        raise RuntimeError(f"seeding {kind}: {applied} of {len(ids)} creates applied")


def pending(
    handle: RunHandle, kind: str, names: list[str], *, update: bool = False
) -> list[Pending]:
    """Actions waiting for a person: per-call updates of version 1, or per-call creates."""
    actions = [
        propose(handle, kind, name, {"touched": name}, if_match='"1"' if update else "")
        for name in names
    ]
    approvals = dict(
        Approval.objects.filter(action__in=actions, status="pending").values_list("action_id", "id")
    )
    if len(approvals) != len(actions):
        raise RuntimeError(f"{len(actions)} proposals opened {len(approvals)} approvals")
    return [Pending(str(a.pk), str(approvals[a.pk]), a.etag) for a in actions]
