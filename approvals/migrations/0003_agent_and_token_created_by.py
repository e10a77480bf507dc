"""Record who created an agent and who minted each agent token (separation of duties).

Existing rows are filled from the audit trail, which names the person behind
every `agent.created` and `token.created` event; rows the trail does not name
(made by `manage.py agent_create`, the demo or the bench) stay null.
"""

from __future__ import annotations

from typing import Any

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def backfill_creators(apps: Any, schema_editor: Any) -> None:
    AuditEvent = apps.get_model("audit", "AuditEvent")
    Agent = apps.get_model("approvals", "Agent")
    AgentToken = apps.get_model("approvals", "AgentToken")
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    people = {str(pk) for pk in User.objects.values_list("pk", flat=True)}
    events = AuditEvent.objects.filter(
        actor_type="person", event_type__in=("agent.created", "token.created")
    ).order_by("seq")
    for event_type, actor_id, details in events.values_list("event_type", "actor_id", "details"):
        if actor_id not in people or not isinstance(details, dict):
            continue
        if event_type == "agent.created" and details.get("agent"):
            Agent.objects.filter(name=details["agent"], created_by__isnull=True).update(
                created_by_id=int(actor_id)
            )
        elif details.get("kind") == "agent" and details.get("prefix"):
            AgentToken.objects.filter(prefix=details["prefix"], created_by__isnull=True).update(
                created_by_id=int(actor_id)
            )


class Migration(migrations.Migration):
    dependencies = [
        ("approvals", "0002_initial"),
        ("audit", "0003_maintenance_needs_superuser"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name="agent",
            name="created_by",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        migrations.AddField(
            model_name="agenttoken",
            name="created_by",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
        migrations.RunPython(backfill_creators, migrations.RunPython.noop, elidable=True),
    ]
