"""Apprise subscriptions saved before this showed the URL's host, which in many services'
URLs is a token (tgram://<bot token>/…): keep the host only where it is a DNS name, as
notifications/services/channels.py `apprise_url_display` now does. (Audit rows already
written keep what they said: the chain is append-only.)"""

from __future__ import annotations

import re
from typing import Any

from django.db import migrations

_DNS_NAME = re.compile(r"^(?=.{1,253}$)(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")


def _hide_token_hosts(apps: Any, schema_editor: Any) -> None:
    subscription_model = apps.get_model("notifications", "Subscription")
    for subscription in subscription_model.objects.filter(channel="apprise"):
        shown = subscription.url_display
        scheme, _, rest = shown.partition("://")
        host = rest.split("/", 1)[0].split(":", 1)[0]
        if host and not _DNS_NAME.match(host):
            subscription.url_display = f"{scheme}://…"
            subscription.save(update_fields=["url_display"])


class Migration(migrations.Migration):
    dependencies = [("notifications", "0001_notifications_outbox")]

    operations = [migrations.RunPython(_hide_token_hosts, migrations.RunPython.noop)]
