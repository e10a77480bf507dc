"""Record on each run who minted the agent token that created it (separation of duties
that survives the token's revocation or expiry).

A run never recorded its token, so existing runs are filled where the minter is known:
the person who minted the agent's tokens that were live when the run was created (created
before it, not yet revoked or expired then), when exactly one person minted them (a token
of the command line beside it leaves the person recorded: on the safe side, they are kept
out). Runs whose live tokens were minted by different people, or only by the command line,
stay null; for them the live-token rule alone applies (separation.answers_for_agent).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

_CHUNK = 1000


def _minter_at(tokens: list[tuple[Any, ...]], moment: datetime) -> int | None:
    """The one person who minted the tokens live at `moment`, or None (none, or several)."""
    minters = {
        minter
        for minter, created, revoked, expires in tokens
        if created <= moment
        and (revoked is None or revoked > moment)
        and (expires is None or expires > moment)
    }
    return minters.pop() if len(minters) == 1 else None


def backfill_minters(apps: Any, schema_editor: Any) -> None:
    AgentToken = apps.get_model("approvals", "AgentToken")
    Run = apps.get_model("approvals", "Run")
    minted = AgentToken.objects.filter(created_by__isnull=False).order_by("agent_id", "pk")
    tokens: dict[Any, list[tuple[Any, ...]]] = defaultdict(list)
    for row in minted.values_list(
        "agent_id", "created_by_id", "created_at", "revoked_at", "expires_at"
    ):
        tokens[row[0]].append(row[1:])
    for agent_id, agent_tokens in tokens.items():
        runs = Run.objects.filter(agent_id=agent_id, token_minted_by__isnull=True)
        by_minter: dict[int, list[Any]] = defaultdict(list)
        for pk, created_at in runs.values_list("pk", "created_at").iterator():
            minter = _minter_at(agent_tokens, created_at)
            if minter is not None:
                by_minter[minter].append(pk)
        for minter, pks in by_minter.items():
            for start in range(0, len(pks), _CHUNK):
                Run.objects.filter(pk__in=pks[start : start + _CHUNK]).update(
                    token_minted_by_id=minter
                )


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0008_action_in_flight_index"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="token_minted_by",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        migrations.RunPython(backfill_minters, migrations.RunPython.noop),
    ]
