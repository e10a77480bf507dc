"""Kill-switch check used before any write.

Scopes: `*` (everything), `kind/prefix*` (a namespace) or an exact `kind/name`.
The write barrier calls `hold_switches_shared` and then `engaged_switch_for`
inside its transaction, so a write whose check runs after an engage has
committed is refused, and an engage waits for writes already past their check.
"""

from __future__ import annotations

import re

from django.db import connection

from console.advisory_locks import KILL_SWITCH
from console.compiled_query import CompiledQuery, Param
from console.models import KillSwitch
from engine.core.errors import KillSwitchEngaged

# The one rule for a scope, used by the service, the API schema and the form:
# `*`, or a kind slug, `/`, and a resource-name prefix with an optional `*`.
SCOPE_PATTERN = r"^(\*|[a-z0-9][a-z0-9_-]{0,63}/[A-Za-z0-9._:@+=,-]{0,254}\*?)$"
SCOPE_MAX_LENGTH = 300
SCOPE_HELP = "'*' or 'kind/prefix*' (e.g. dns-record/prod-*)"
_SCOPE = re.compile(SCOPE_PATTERN)


def scope_is_valid(scope: str) -> bool:
    """Is `scope` (already stripped) a kill-switch scope the service accepts?"""
    return len(scope) <= SCOPE_MAX_LENGTH and _SCOPE.fullmatch(scope) is not None


# One PostgreSQL advisory lock orders every write against every engage/release:
# a write transaction (the barrier, an undo) holds it SHARED from before its
# kill-switch check until it commits; `kill_switch_set` takes it EXCLUSIVE
# before it changes a switch. So an engage waits for the writes already past
# their check, and a write that starts its check after an engage began waits
# for the engage to commit and then sees it (READ COMMITTED: a new statement
# sees the latest commit). Lock order: this lock before any row lock.
_SWITCH_LOCK = (KILL_SWITCH, 1)
# hold_switches_shared's statement, for a caller that sends it with others (write_rows.py).
SWITCH_LOCK_SHARED = f"SELECT pg_advisory_xact_lock_shared{_SWITCH_LOCK}"


def hold_switches_shared() -> None:
    """Inside a write transaction, before the kill-switch check and any row lock."""
    if connection.vendor != "postgresql":
        return  # SQLite serialises writers already.
    with connection.cursor() as cursor:
        cursor.execute(SWITCH_LOCK_SHARED)


def lock_switches_exclusive() -> None:
    """Inside an engage/release transaction, before the switch row and the audit append."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", list(_SWITCH_LOCK))


# Asked by every write proposal that needs no approval, and by the write barrier.
_ENGAGED_SWITCHES = CompiledQuery(
    lambda: KillSwitch.objects.filter(
        engaged=Param("engaged", KillSwitch._meta.get_field("engaged"))
    ).only("id", "scope", "reason")
)


def engaged_switches() -> list[KillSwitch]:
    """Every engaged switch (their id, scope and reason)."""
    switches: list[KillSwitch] = _ENGAGED_SWITCHES.all(engaged=True)
    return switches


def engaged_switch_for(resource_identifier: str) -> KillSwitch | None:
    """The engaged switch covering `resource_identifier`, or None.

    When several cover it, the broadest wins (`*`, then the shortest prefix),
    so the reason shown is the one an operator must release last.
    """
    covering = [switch for switch in engaged_switches() if switch.covers(resource_identifier)]
    if not covering:
        return None
    return min(covering, key=lambda switch: (switch.scope != "*", len(switch.scope)))


def refuse_if_engaged(resource_identifier: str) -> None:
    """KillSwitchEngaged (retryable) when a switch covers the resource: the barrier's
    and the undo's check under the shared switch lock."""
    switch = engaged_switch_for(resource_identifier)
    if switch is not None:
        raise KillSwitchEngaged(
            f"kill switch {switch.scope} is engaged: {switch.reason}".rstrip(": "),
            extra={
                "scope": switch.scope,
                "reason": switch.reason,
                "resource": resource_identifier,
            },
        )


def any_engaged() -> bool:
    return KillSwitch.objects.filter(engaged=True).exists()
