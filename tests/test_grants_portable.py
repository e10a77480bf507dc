"""A grant's use on the embedded SQLite database (`make run`'s default) follows the rule the
PostgreSQL statement does (approvals/services/grants.py `_grant_use_portable`): the same
sequence of proposals against the same grants admits the same writes through the same grants
with the same uses left — live, revoked, expired, used up, another run's, an agent-wide grant
(and its minter's run), an inactive owner, the prefix. Run here on PostgreSQL, each rule in a
transaction rolled back, so the two are compared on one set of rows; and once on a real
embedded SQLite database in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from approvals.models import Grant, Run
from approvals.services import grants
from tests.conftest import ROOT, subprocess_env
from tests.fixtures.api import make_active_run, make_agent_with_token, make_person_with_token
from tests.test_grants import _flags_run

pytestmark = pytest.mark.django_db


class _Rollback(Exception):
    pass


def _elsewhere(prefix: str) -> list[dict[str, Any]]:
    """A write set apart from the flags run's (two active runs never overlap); a grant's use
    does not look at write sets (its creation did)."""
    return [{"resource": f"feature-flag/{prefix}-*", "operations": ["create"]}]


def _grant(run: Run | None, agent: Any, owner: Any, prefix: str, **fields: Any) -> Grant:
    values: dict[str, Any] = {
        "kind_id": "feature-flag",
        "operation": "create",
        "name_prefix": prefix,
        "scope": "run" if run is not None else "agent",
        "run": run,
        "agent": agent,
        "owner": owner,
        "uses": 2,
        "expires_at": timezone.now() + timedelta(hours=1),
        **fields,
    }
    return Grant.objects.create(**values)


def _uses(rule: Any, calls: list[tuple[Run, str]]) -> list[tuple[int, int] | None]:
    """What `rule` admits for each call in turn, then everything undone."""
    seen: list[tuple[int, int] | None] = []
    try:
        with transaction.atomic():
            for run, name in calls:
                use = rule(
                    run=run, kind="feature-flag", name=name, operation="create", now=timezone.now()
                )
                seen.append(None if use is None else (use.grant_id, use.uses_left))
            raise _Rollback
    except _Rollback:
        pass
    return seen


def test_the_portable_rule_admits_what_the_postgresql_statement_admits() -> None:
    bot = make_agent_with_token("flag-bot").agent
    mine = _flags_run(bot).run
    other = make_active_run(make_agent_with_token("other-bot").agent, _elsewhere("other")).run
    ana = make_person_with_token("ana", "operators").user
    gone = make_person_with_token("gus", "operators").user
    get_user_model().objects.filter(pk=gone.pk).update(is_active=False)
    minter = make_person_with_token("mia", "operators").user
    minted = make_active_run(bot, _elsewhere("minted")).run
    Run.objects.filter(pk=minted.pk).update(token_minted_by=minter)
    minted.refresh_from_db()
    past = timezone.now() - timedelta(minutes=1)

    live = _grant(mine, bot, ana, "team-a-")
    _grant(mine, bot, ana, "team-a-", revoked_at=past)
    _grant(mine, bot, ana, "team-a-", expires_at=past)
    _grant(mine, bot, ana, "team-a-", used=2)
    _grant(mine, bot, gone, "team-a-x")  # its owner left: admits nothing
    theirs = _grant(other, bot, ana, "team-a-")
    agent_wide = _grant(None, bot, minter, "team-b-", uses=5)

    calls = [
        (mine, "team-a-one"),
        (mine, "team-a-xyz"),
        (mine, "team-a-two"),  # live is used up: nothing else admits it
        (mine, "team-b-one"),  # the agent-wide grant
        (minted, "team-b-two"),  # ... never in the run its owner minted
        (other, "team-a-one"),  # their own run's grant
        (mine, "zzz"),
        (mine, ""),
    ]
    portable = _uses(grants._grant_use_portable, calls)
    statement = _uses(grants.grant_use_for_proposal, calls)
    assert portable == statement
    assert portable == [
        (live.pk, 1),
        (live.pk, 0),
        None,
        (agent_wide.pk, 4),
        None,
        (theirs.pk, 1),
        None,
        None,
    ]


# The same rule on the embedded SQLite database itself, as `make run` starts it by default:
# a process of its own (its own settings: no DATABASE_URL), migrated from nothing.
_ON_SQLITE = """
import json
import os
from datetime import timedelta

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup()
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from approvals.models import Agent, Grant, Run
from approvals.services.grants import grant_use_for_proposal
from ownership.models import ConflictClass, ResourceKind

call_command("migrate", verbosity=0)
assert connection.vendor == "sqlite"
later = timezone.now() + timedelta(hours=1)
pointer = ConflictClass.objects.get(slug="advance_pointer")
kind = ResourceKind.objects.create(
    slug="feature-flag", owner_group="platform",
    class_create=pointer, class_update=pointer, class_delete=pointer,
)
agent = Agent.objects.create(name="flag-bot")
run = Run.objects.create(
    agent=agent, task="t", status="active", write_set=[],
    expires_at=later, max_expires_at=later,
)
grant = Grant.objects.create(
    kind=kind, operation="create", name_prefix="team-a-", run=run, agent=agent,
    owner=get_user_model().objects.create(username="ana"), uses=2, expires_at=later,
)
seen = []
for name in ["team-a-1", "zzz", "team-a-2", "team-a-3"]:
    with transaction.atomic():
        use = grant_use_for_proposal(
            run=run, kind="feature-flag", name=name, operation="create", now=timezone.now()
        )
    seen.append(None if use is None else [use.grant_id == grant.pk, use.uses_left])
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_a_grant_admits_its_uses_on_the_embedded_sqlite_database(tmp_path: Path) -> None:
    env = subprocess_env(AIRLOCK_DATA_DIR=str(tmp_path))
    env.pop("DATABASE_URL")
    done = subprocess.run(
        [sys.executable, "-c", _ON_SQLITE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Two uses: the first and third matching writes admitted, the prefix held, then none.
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[True, 1], None, [True, 0], None]
