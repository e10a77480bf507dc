"""Reference data every Airlock database has: the five conflict classes and the role groups.

Plain constants so the data migration and the test-suite re-seeding share one list. A key
added after 0002 (`grants_allowed`) is set by the migration that adds its field.
"""

from __future__ import annotations

from typing import Any

CLASS_DEFAULTS: dict[str, Any] = {
    "quorum": 1,
    "undo_window_seconds": 600,
    "approval_ttl_seconds": 172_800,
}

CLASSES: list[dict[str, Any]] = [
    {
        "slug": "add_unique",
        "name": "Add a uniquely named independent resource",
        "description": "Creating something whose name must be free. On a version conflict the "
        "agent re-reads and retries while the name is still free.",
        "approval_mode": "per_run",
        "on_conflict": "retry",
        "resolver": "agent",
    },
    {
        "slug": "recompute_field",
        "name": "Update a field computed from current data",
        "description": "A value derived from the current state (a report, a counter). On a "
        "version conflict the agent re-reads, recomputes and retries.",
        "approval_mode": "per_run",
        "on_conflict": "recompute",
        "resolver": "agent",
    },
    {
        "slug": "advance_pointer",
        "name": "Advance a shared release pointer",
        "description": "Moving a shared pointer (release, traffic target). On a version conflict "
        "stop and present both candidates to the release owners.",
        "approval_mode": "per_call",
        "on_conflict": "present_candidates",
        "resolver": "group:release-owners",
    },
    {
        "slug": "access_change",
        "grants_allowed": False,
        "name": "Change members or access permissions",
        "description": "Membership and permission changes. On a version conflict stop and "
        "request review by the account owners.",
        "approval_mode": "per_call",
        "on_conflict": "request_review",
        "resolver": "group:account-owners",
    },
    {
        "slug": "replace_shared_document",
        "grants_allowed": False,
        "name": "Delete or replace a shared configuration document",
        "description": "Full-document replacement or deletion of shared configuration. On a "
        "version conflict stop unless an explicit lease covers it; a named operator group "
        "resolves.",
        "approval_mode": "per_call",
        "on_conflict": "stop_unless_lease",
        "resolver": "group:operators",
    },
]

GROUPS: list[str] = [
    "operators",
    "owners",
    "admins",
    "auditors",
    "release-owners",
    "account-owners",
]
