"""`python manage.py demo`: demo data made through the real API, so every page has something.

Reference data is created idempotently: resource kinds and the resources at their starting
versions with the ORM (seed rows, as a migration would); people and agents through their
services (`person_create`, `agent_create`: validated and audited like the console's).
Everything an agent or an operator does goes through the REST API — in-process through
Django's full request stack by default, or against a running server with
`--base-url http://127.0.0.1:8000` — and approved writes are executed by a real RQ worker
(an in-process burst worker on the real queue, or the server's own workers with --base-url).

The story (the design's collision, seeds/003):
1. `alerts-bot-b` and `alerts-bot-a` both read notification-policy/prod-alerts at version 41.
2. B sets severity to critical (per-call approval by the operator `ana`) → applied, version 42,
   still inside its undo window.
3. A's full-document replace based on 41 is refused with 412 stale_version (audited).
4. A re-reads 42 and proposes adding a backup destination → a per-call approval left waiting.
5. `release-bot` proposes two candidates for release-pointer/prod-eu, both based on version 7;
   the first is approved and applied, the second meets version 8 at execution → an open
   conflict for the release owners.
6. `release-bot` proposes a two-step plan: one approval waiting.
7. A kind that is not Airlock's own store (console/management/demo_target.py): tenant-config,
   files in a git repository under the data folder. `tenant-bot` reads tenant-config/acme.json
   (its ETag is the file's blob id) and proposes more seats; `ana` approves; the worker commits
   it to the repository through the git adapter.
notification-policy/staging-alerts is left to no run: the README's quick-start writes there.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.test import Client
from rq import SimpleWorker

from approvals.models import Agent
from approvals.outbox import engine_queue
from approvals.services.tokens import agent_create, agent_token_create, personal_token_create
from audit.services import Actor
from console.management.demo_target import GIT_RESOURCE, demo_repository, ensure_git_kind
from console.people import person_create
from console.reference import ensure_reference_data
from ownership.models import Resource, ResourceKind, ResourceVersion

DEMO_MARKER_AGENT = "alerts-bot-a"
UNDO_WINDOW_SECONDS = 24 * 3600  # long enough that a newcomer still sees the undo button

KINDS: list[dict[str, Any]] = [
    {
        "slug": "notification-policy",
        "description": "Alert routing policies (shared configuration documents).",
        "class_create_id": "add_unique",
        "class_update_id": "replace_shared_document",
        "class_delete_id": "replace_shared_document",
        "owner_group": "platform",
    },
    {
        "slug": "release-pointer",
        "description": "Which release each environment serves.",
        "class_create_id": "add_unique",
        "class_update_id": "advance_pointer",
        "class_delete_id": "advance_pointer",
        "owner_group": "release-owners",
    },
]

RESOURCES: list[dict[str, Any]] = [
    {
        "kind": "notification-policy",
        "name": "prod-alerts",
        "version": 41,
        "document": {"destinations": ["oncall@example.test"], "severity": "high"},
        "owner_group": "platform",
    },
    {
        "kind": "release-pointer",
        "name": "prod-eu",
        "version": 7,
        "document": {"release": "2026.11.2", "notes": "steady"},
        "owner_group": "release-owners",
    },
    {
        "kind": "release-pointer",
        "name": "prod-us",
        "version": 3,
        "document": {"release": "2026.11.2", "notes": "steady"},
        "owner_group": "release-owners",
    },
    # Held by no demo run: the README's agent quick-start writes here, so that it works as
    # written on a fresh `make run` (every other resource is in an active demo run's write set).
    {
        "kind": "notification-policy",
        "name": "staging-alerts",
        "version": 1,
        "document": {"destinations": ["oncall@example.test"], "severity": "low"},
        "owner_group": "platform",
    },
    {
        "kind": "notification-policy",
        "name": "release-watch",
        "version": 5,
        "document": {"watching": "2026.11.2", "destinations": ["release@example.test"]},
        "owner_group": "platform",
    },
]

# username, roles, owner groups
PEOPLE: list[tuple[str, list[str], list[str]]] = [
    ("ana", ["operator"], []),
    ("rui", ["owner"], ["release-owners"]),
    ("paula", ["owner"], ["platform"]),
]

AGENTS: list[tuple[str, str]] = [
    ("alerts-bot-a", "Keeps alert routing complete (adds missing destinations)."),
    ("alerts-bot-b", "Raises alert severity during incidents."),
    ("release-bot", "Advances release pointers after green builds."),
    ("tenant-bot", "Keeps tenants' configuration in step with their orders."),
]


class DemoFailed(CommandError):
    pass


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]


class Transport:
    """The REST API, in-process (Django test client: the full request stack) or over HTTP."""

    def __init__(self, base_url: str | None) -> None:
        self.base_url = base_url.rstrip("/") if base_url else None
        if self.base_url is None:
            hosts = [h for h in settings.ALLOWED_HOSTS if h and h != "*" and not h.startswith(".")]
            self.client = Client(HTTP_HOST=hosts[0] if hosts else "localhost")

    def call(
        self,
        method: str,
        path: str,
        *,
        token: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        hdrs = {"Authorization": f"Bearer {token}", **(headers or {})}
        content_type = hdrs.pop("Content-Type", "application/json")
        data = json.dumps(body) if body is not None else None
        if self.base_url is not None:
            if data is not None:
                hdrs["Content-Type"] = content_type
            response = httpx.request(
                method, self.base_url + path, content=data, headers=hdrs, timeout=30
            )
            try:
                parsed = response.json()
            except ValueError:
                parsed = response.text
            return Reply(
                response.status_code, parsed, {k.lower(): v for k, v in response.headers.items()}
            )
        kwargs: dict[str, Any] = {"headers": hdrs}
        if data is not None:
            kwargs.update(data=data, content_type=content_type)
        local = self.client.generic(method, path, **kwargs)
        raw = local.content
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        return Reply(local.status_code, parsed, {k.lower(): v for k, v in local.headers.items()})


class Command(BaseCommand):
    help = (
        "Load demo data through the real API: a collision, a waiting approval, an undo, a conflict."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--base-url",
            default=None,
            help="Drive a running server (its RQ workers execute) instead of in-process.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if Agent.objects.filter(name=DEMO_MARKER_AGENT).exists():
            self.stdout.write("demo: already loaded (agent alerts-bot-a exists); nothing to do")
            return
        self.api = Transport(options.get("base_url"))
        self.inprocess = options.get("base_url") is None
        tokens = self.reference_data()
        self.story(tokens)

    # --- reference data (idempotent) ----------------------------------------------------------

    def reference_data(self) -> dict[str, str]:
        ensure_reference_data()
        system = Actor.system("demo")
        tokens: dict[str, str] = {}
        with transaction.atomic():
            for kind in KINDS:
                ResourceKind.objects.update_or_create(
                    slug=kind["slug"],
                    defaults={**kind, "undo_window_seconds": UNDO_WINDOW_SECONDS},
                )
            for spec in RESOURCES:
                self.seed_resource(spec)
            self.git_kind = ensure_git_kind(undo_window_seconds=UNDO_WINDOW_SECONDS)
            user_model = get_user_model()
            for username, roles, groups in PEOPLE:
                person = user_model.objects.filter(username=username).first()
                if person is None:
                    person = person_create(
                        user=system,
                        username=username,
                        password=None,  # the demo people act through the API only
                        roles=roles,
                        groups=groups,
                        email=f"{username}@example.test",
                    )
                _pt, tokens[username] = personal_token_create(
                    user=person, actor=system, label="demo"
                )
            for name, description in AGENTS:
                agent = Agent.objects.filter(name=name).first()
                if agent is None:
                    _agent, tokens[name] = agent_create(
                        name=name, actor=system, owner="paula", description=description
                    )
                else:
                    _at, tokens[name] = agent_token_create(agent=agent, actor=system, label="demo")
        return tokens

    def seed_resource(self, spec: dict[str, Any]) -> None:
        """A resource at its starting version, as if it predated Airlock (no write, no audit)."""
        resource, created = Resource.objects.get_or_create(
            kind_id=spec["kind"],
            name=spec["name"],
            defaults={
                "document": spec["document"],
                "version": spec["version"],
                "owner_group": spec["owner_group"],
            },
        )
        if created:
            ResourceVersion.objects.create(
                resource=resource,
                version=spec["version"],
                document=spec["document"],
                operation="seed",
            )

    # --- the story (the real API) --------------------------------------------------------------

    def expect(self, reply: Reply, status: int, what: str) -> Any:
        if reply.status != status:
            raise DemoFailed(f"demo: {what}: expected {status}, got {reply.status}: {reply.body}")
        return reply.body

    def start_run(
        self, tokens: dict[str, str], agent: str, resource: str, task: str
    ) -> tuple[str, str]:
        body = self.expect(
            self.api.call(
                "POST",
                "/api/v1/runs",
                token=tokens[agent],
                body={
                    "task": task,
                    "write_set": [{"resource": resource, "operations": ["update"]}],
                    "ttl_seconds": 8 * 3600,
                },
            ),
            201,
            f"{agent} starts a run",
        )
        run_id, run_token = body["id"], body["token"]
        if body["status"] == "pending_approval":
            self.decide(tokens, subject="run", match=run_id, what=f"{agent}'s run")
        return run_id, run_token

    def pending_approvals(self, tokens: dict[str, str]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor = ""
        for _ in range(50):
            path = "/api/v1/approvals?status=pending&limit=200" + (
                f"&cursor={cursor}" if cursor else ""
            )
            page = self.expect(self.api.call("GET", path, token=tokens["ana"]), 200, "approvals")
            items += page["items"]
            cursor = page.get("next") or ""
            if not cursor:
                break
        return items

    def decide(self, tokens: dict[str, str], *, subject: str, match: str, what: str) -> None:
        key = "run" if subject == "run" else "action"
        for item in self.pending_approvals(tokens):
            if item.get("subject") == subject and str(item.get(key)) == match:
                self.expect(
                    self.api.call(
                        "POST",
                        f"/api/v1/approvals/{item['id']}/decision",
                        token=tokens["ana"],
                        body={"decision": "approve", "comment": f"demo: approve {what}"},
                    ),
                    200,
                    f"ana approves {what}",
                )
                return
        raise DemoFailed(f"demo: no pending approval for {what}")

    def write(
        self,
        run_token: str,
        resource: str,
        etag: str,
        *,
        patch: Any = None,
        document: Any = None,
        reason: str,
        expect: int = 202,
    ) -> Reply:
        """A conditional write: a merge `patch` (PATCH) or a whole `document` (PUT)."""
        method = "PUT" if patch is None else "PATCH"
        headers = {
            "If-Match": etag,
            "Idempotency-Key": f"demo-{uuid.uuid4().hex}",
            "Airlock-Reason": reason,
        }
        if patch is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        reply = self.api.call(
            method,
            f"/api/v1/resources/{resource}",
            token=run_token,
            body=document if patch is None else patch,
            headers=headers,
        )
        self.expect(reply, expect, f"{method} {resource} If-Match {etag}")
        return reply

    def read(self, token: str, resource: str) -> tuple[str, dict[str, Any]]:
        reply = self.api.call("GET", f"/api/v1/resources/{resource}", token=token)
        body = self.expect(reply, 200, f"read {resource}")
        return reply.headers.get("etag") or f'"{body["version"]}"', body

    def run_worker(self) -> None:
        """Execute queued actions: an in-process burst worker on the real RQ queue."""
        if not self.inprocess:
            return
        queue = engine_queue()
        rq_log = logging.getLogger("rq.worker")
        level = rq_log.level
        rq_log.setLevel(logging.WARNING)
        # RQ's worker installs its own SIGINT/SIGTERM handlers: give the caller its own back.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            SimpleWorker([queue], connection=queue.connection).work(
                burst=True, with_scheduler=False, logging_level="WARNING"
            )
        finally:
            rq_log.setLevel(level)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def wait_status(
        self, token: str, action_id: str, wanted: set[str], what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.run_worker()
            body = self.expect(
                self.api.call("GET", f"/api/v1/actions/{action_id}", token=token), 200, what
            )
            if body["status"] in wanted:
                return body
            time.sleep(0.2)
        raise DemoFailed(f"demo: {what} stayed {body.get('status')!r}, wanted {sorted(wanted)}")

    def say(self, message: str) -> None:
        self.stdout.write(f"demo: {message}")

    def story(self, tokens: dict[str, str]) -> None:
        self.collision(tokens)
        self.releases(tokens)
        self.plan(tokens)
        if self.git_kind is not None:
            self.git_config(tokens)
        else:
            self.say(f"git is not installed: {GIT_RESOURCE} (a git-backed kind) is skipped")
        self.say(
            "done — the console now shows approvals waiting (one of them a two-step plan), "
            "an undoable write, a conflict and a kind whose files live in a git repository"
        )

    def collision(self, tokens: dict[str, str]) -> None:
        """Steps 1-4: two agents, one version, one stale full replace, one re-plan."""
        policy = "notification-policy/prod-alerts"

        # 1. Both agents read version 41.
        etag_b, _ = self.read(tokens["alerts-bot-b"], policy)
        etag_a, doc_a = self.read(tokens["alerts-bot-a"], policy)
        self.say(f"alerts-bot-a and alerts-bot-b read {policy} at {etag_a}")

        # 2. B raises severity (per-call approval), applied → 42, inside its undo window.
        run_b, token_b = self.start_run(
            tokens, "alerts-bot-b", policy, "Raise prod alert severity during incident INC-4711"
        )
        reply = self.write(
            token_b,
            policy,
            etag_b,
            patch={"severity": "critical"},
            reason="INC-4711: pages must wake someone",
        )
        action_b = reply.body["id"]
        self.decide(tokens, subject="action", match=action_b, what="B's severity change")
        applied = self.wait_status(token_b, action_b, {"applied"}, "B's severity change")
        self.say(f"B's severity change applied: {applied['execution']['result_etag']} (undoable)")
        self.expect(
            self.api.call("POST", f"/api/v1/runs/{run_b}/finish", token=token_b, body={}),
            200,
            "B finishes its run",
        )

        # 3. A's full replace based on 41 is refused.
        _run_a, token_a = self.start_run(
            tokens, "alerts-bot-a", policy, "Add a backup destination to prod alerts"
        )
        full = {**doc_a["document"]}
        full["destinations"] = [*full["destinations"], "backup@example.test"]
        refused = self.write(
            token_a, policy, etag_a, document=full, reason="add backup destination", expect=412
        )
        self.say(
            f"A's full replace based on {refused.body.get('expected_etag')} refused: "
            f"current is {refused.body.get('current_etag')} (stale_version)"
        )

        # 4. A re-reads and proposes only its own change: a per-call approval left waiting.
        etag_a2, doc_a2 = self.read(token_a, policy)
        waiting = self.write(
            token_a,
            policy,
            etag_a2,
            patch={"destinations": [*doc_a2["document"]["destinations"], "backup@example.test"]},
            reason="add backup destination (re-planned on the current version)",
        )
        self.say(f"A re-planned on {etag_a2}: action {waiting.body['id']} waits for an operator")

    def releases(self, tokens: dict[str, str]) -> None:
        """Step 5: two release candidates based on version 7: one applies, one conflicts."""
        pointer = "release-pointer/prod-eu"
        _run_r, token_r = self.start_run(
            tokens, "release-bot", pointer, "Advance prod-eu after green builds"
        )
        etag_r, _ = self.read(token_r, pointer)
        # Both candidates are based on the same version: the second meets the first.
        first, second = (
            self.write(
                token_r,
                pointer,
                etag_r,
                patch={"release": release},
                reason=f"build {release} green",
            ).body["id"]
            for release in ("2026.11.3", "2026.12.0-rc1")
        )
        self.decide(tokens, subject="action", match=first, what="release 2026.11.3")
        self.wait_status(token_r, first, {"applied"}, "release 2026.11.3")
        self.decide(tokens, subject="action", match=second, what="release 2026.12.0-rc1")
        conflict = self.wait_status(token_r, second, {"conflict"}, "release 2026.12.0-rc1")
        detail = conflict.get("conflict") or {}
        self.say(
            f"release 2026.12.0-rc1 met a newer version at execution: conflict "
            f"{detail.get('conflict_id')} for {detail.get('resolver')}"
        )

    def plan(self, tokens: dict[str, str]) -> None:
        """Step 6: one change across two resources, proposed as a plan: approved as one."""
        pointer, watch = "release-pointer/prod-us", "notification-policy/release-watch"
        body = self.expect(
            self.api.call(
                "POST",
                "/api/v1/runs",
                token=tokens["release-bot"],
                body={
                    "task": "Ship 2026.11.3 to prod-us and point its release watch at it",
                    "write_set": [
                        {"resource": pointer, "operations": ["update"]},
                        {"resource": watch, "operations": ["update"]},
                    ],
                    "ttl_seconds": 8 * 3600,
                },
            ),
            201,
            "release-bot starts its plan's run",
        )
        run_id, token = body["id"], body["token"]
        if body["status"] == "pending_approval":
            self.decide(tokens, subject="run", match=run_id, what="release-bot's plan run")
        etag_pointer, _ = self.read(token, pointer)
        etag_watch, _ = self.read(token, watch)
        plan = self.expect(
            self.api.call(
                "POST",
                f"/api/v1/runs/{run_id}/plans",
                token=token,
                body={
                    "reason": "ship 2026.11.3 to prod-us and watch it",
                    "steps": [
                        {
                            "resource": pointer,
                            "method": "PATCH",
                            "if_match": etag_pointer,
                            "patch": {"release": "2026.11.3"},
                        },
                        {
                            "resource": watch,
                            "method": "PATCH",
                            "if_match": etag_watch,
                            "patch": {"watching": "2026.11.3"},
                        },
                    ],
                },
                headers={"Idempotency-Key": f"demo-{uuid.uuid4().hex}"},
            ),
            202,
            "release-bot proposes a two-step plan",
        )
        self.say(f"release-bot proposed plan {plan['id']}: two steps, one approval waiting")

    def git_config(self, tokens: dict[str, str]) -> None:
        """Step 7: a write to a file in a git repository, approved and committed by the worker
        (the kind's target is git: its version is the blob id, its write a commit)."""
        run_id, token = self.start_run(
            tokens, "tenant-bot", GIT_RESOURCE, "Acme bought 7 more seats (order 1042)"
        )
        etag, body = self.read(token, GIT_RESOURCE)
        seats = int(body["document"].get("seats") or 0) + 7
        reply = self.write(
            token, GIT_RESOURCE, etag, patch={"seats": seats}, reason="order 1042: 7 more seats"
        )
        action = reply.body["id"]
        self.decide(tokens, subject="action", match=action, what="acme's seats")
        applied = self.wait_status(token, action, {"applied"}, "acme's seats")
        self.expect(
            self.api.call("POST", f"/api/v1/runs/{run_id}/finish", token=token, body={}),
            200,
            "tenant-bot finishes its run",
        )
        self.say(
            f"tenant-bot's change to {GIT_RESOURCE} approved by ana and committed to "
            f"{demo_repository()}: {etag} -> {applied['execution']['result_etag']}"
        )
