"""The client reads a resource of a kind with an external target: its version is the target's
opaque token (text), kept as it is; Airlock's own store still gives an integer."""

from __future__ import annotations

from airlock_client.models import Resource


def test_an_external_targets_token_is_kept_as_text() -> None:
    blob = "3b18e512dba79e4c8300dd08aeb37f8e728b8dad"
    body = {"kind": "config-file", "name": "tenants/a.json", "version": blob, "document": {}}
    resource = Resource.from_json(body, etag=f'"{blob}"')
    assert resource.version == blob and resource.etag == f'"{blob}"'


def test_the_managed_stores_counter_stays_an_integer() -> None:
    body = {"kind": "notification-policy", "name": "prod-alerts", "version": 41, "document": {}}
    resource = Resource.from_json(body, etag=None)
    assert resource.version == 41 and resource.etag == '"41"'
