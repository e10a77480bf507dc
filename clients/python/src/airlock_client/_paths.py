"""The paths the client sends, built so that no argument can leave its place.

An id (a run's, an action's, a plan's) must be a UUID, and is sent in its canonical
form; a resource's kind and name are each one path segment, percent-encoded whole
(`/`, `?`, `#` and `%` included) and never `.` or `..`, which HTTP stacks resolve as
"this" and "the parent" directory. So an id or a name chosen by a model — `../../agents`,
`x?y` — is refused here with `InvalidIdentifier` before anything is sent, instead of
reaching another endpoint.
"""

from __future__ import annotations

import uuid
from urllib.parse import quote

from airlock_client.errors import InvalidIdentifier

API_PREFIX = "/api/v1"


def uuid_id(value: object, what: str) -> str:
    """`value` as a canonical UUID string (how the API names runs, actions and plans)."""
    if isinstance(value, uuid.UUID):
        return str(value)
    try:
        return str(uuid.UUID(value if isinstance(value, str) else ""))
    except ValueError:
        raise InvalidIdentifier(f"{what} must be a UUID, got {value!r}") from None


def segment(value: str, what: str) -> str:
    """One path segment, percent-encoded whole; never empty, `.` or `..`."""
    if not isinstance(value, str) or value in ("", ".", ".."):
        raise InvalidIdentifier(f"{what} must be a non-empty name (not '.' or '..'): {value!r}")
    return quote(value, safe="")


def resource_path(resource: str) -> str:
    """`kind/name` (the name may itself hold `/`: it stays one segment)."""
    kind, sep, name = resource.partition("/") if isinstance(resource, str) else ("", "", "")
    if not sep or not kind or not name:
        raise InvalidIdentifier(f"resource must be 'kind/name', got {resource!r}")
    return f"{API_PREFIX}/resources/{segment(kind, 'kind')}/{segment(name, 'name')}"


def run_path(run_id: object, *rest: str) -> str:
    return "/".join((f"{API_PREFIX}/runs", uuid_id(run_id, "run id"), *rest))


def action_path(action_id: object, *rest: str) -> str:
    return "/".join((f"{API_PREFIX}/actions", uuid_id(action_id, "action id"), *rest))


def plan_path(plan_id: object) -> str:
    return f"{API_PREFIX}/plans/{uuid_id(plan_id, 'plan id')}"
