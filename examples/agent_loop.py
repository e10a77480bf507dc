"""A minimal Airlock agent: read -> propose -> wait -> on a stale version, re-read and re-plan.

Against `make run`'s demo (server on http://127.0.0.1:8000), in a second terminal:

    make agent-example

which registers the agent `example-bot` and runs this file with its token (or by hand:
AIRLOCK_URL=http://127.0.0.1:8000 AIRLOCK_AGENT_TOKEN=ak_... .venv/bin/python
examples/agent_loop.py). Sign in to the console as `admin` and approve, on the Approvals
page, first the run (its identity and write set), then its change (a per-call approval).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from airlock_client import Airlock, NotFound, RunNotApproved, StaleVersion

RESOURCE = "notification-policy/example-alerts"
BACKUP = "backup@example.test"


def plan(document: dict[str, Any]) -> dict[str, Any] | None:
    """The change this agent wants, as a JSON merge patch of what it read (None: done)."""
    destinations = list(document.get("destinations", []))
    if BACKUP in destinations:
        return None
    return {"destinations": [*destinations, BACKUP]}


def main() -> int:
    url = os.environ.get("AIRLOCK_URL", "http://127.0.0.1:8000")
    with Airlock(url, os.environ["AIRLOCK_AGENT_TOKEN"], retry_budget=30) as airlock:
        print(f"Starting a run: approve it at {url}/approvals", flush=True)
        try:
            run = airlock.start_run(
                "Make sure example-alerts also pages the backup address",
                [(RESOURCE, ["create", "update"])],
                approval_timeout=600,
            )
        except RunNotApproved as refused:
            print(f"The run was not approved: {refused}")
            return 1
        with run:  # heartbeats while open, finishes on exit
            for _ in range(5):
                try:
                    current = run.read(RESOURCE)
                except NotFound:
                    seed = {"destinations": ["oncall@example.test"], "severity": "high"}
                    created = run.wait(run.create(RESOURCE, seed, reason="seed"), timeout=120)
                    print(f"Created {RESOURCE}: {created.status}", flush=True)
                    continue
                patch = plan(current.document)
                if patch is None:
                    print(f"{RESOURCE} at {current.etag} already pages {BACKUP}: nothing to do")
                    return 0
                try:
                    action = run.patch(current, patch, reason=f"page {BACKUP} too")
                except StaleVersion as stale:
                    # Someone changed it since we read it (or an approved write queued over
                    # it will): wait for that write if named, then re-read and re-plan.
                    print(f"Stale: we read {stale.expected_etag}, it is now {stale.current_etag}")
                    run.wait_for_supersede(stale, timeout=120)
                    continue
                print(f"Proposed {action.id} ({action.status}): approve it at {url}/approvals")
                action = run.wait(action, timeout=600)
                if action.status == "applied":
                    print(f"Applied: {RESOURCE} is now at {action.result_etag}")
                    return 0
                if action.status == "conflict" and action.retryable_by_agent:
                    continue  # it moved before execution: re-read and re-plan
                detail = action.rejection_comment or action.conflict or action.error
                print(f"Ended as {action.status}: {detail}")
                return 1
        print("Gave up after five attempts")
        return 1


if __name__ == "__main__":
    sys.exit(main())
