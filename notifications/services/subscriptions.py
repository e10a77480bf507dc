"""Subscriptions: admin-only verbs, validated and audited (never with a secret).

`subscription_create` and `subscription_secret_rotate` return the webhook secret in clear
once (`Created.secret`); it is stored encrypted and never shown again. The URL of a webhook
is checked against the address rules (notifications/services/addresses.py) on every save.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypedDict, Unpack

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.services import Actor, audit_append
from console.permissions import is_admin, require_person
from engine.core.errors import InvalidTransition, NotFound, ValidationFailed
from notifications.models import EVERYONE, Channel, Delivery, Subscription
from notifications.services.addresses import url_display, webhook_url_check
from notifications.services.channels import apprise_url_display, apprise_url_problem
from notifications.services.events import (
    NOTIFICATION_TYPES,
    Facts,
    Listener,
    deep_link,
    notification_record,
)
from notifications.services.secrets import seal, webhook_secret_new

_ADMINS_ONLY = "Only admins manage notification subscriptions."
_GROUP = re.compile(r"^[A-Za-z0-9_.@+-]{1,150}$")


class SubscriptionFields(TypedDict, total=False):
    """What create and update take (update: only the fields given change)."""

    name: str
    target: str
    event_types: list[str]
    kind: str
    name_prefix: str
    channel: str
    url: str
    paused: bool


@dataclass(frozen=True)
class Created:
    subscription: Subscription
    secret: str  # the webhook secret in clear, this once ("" for other channels)


def subscription_as_dict(subscription: Subscription) -> dict[str, Any]:
    """A subscription as the API, the console and the audit trail show it: no secret, and
    of the URL only its scheme and host."""
    return {
        "id": subscription.pk,
        "name": subscription.name,
        "target": subscription.target,
        "event_types": list(subscription.event_types or []),
        "kind": subscription.kind,
        "name_prefix": subscription.name_prefix,
        "channel": subscription.channel,
        "url": subscription.url_display,
        "paused": subscription.paused,
        "disabled_at": subscription.disabled_at.isoformat() if subscription.disabled_at else None,
        "disabled_reason": subscription.disabled_reason,
        "secret_rotating_until": (
            subscription.previous_secret_until.isoformat()
            if subscription.previous_secret_until
            and subscription.previous_secret_until > timezone.now()
            else None
        ),
        "created_by": subscription.created_by.get_username() if subscription.created_by else None,
        "created_at": subscription.created_at.isoformat() if subscription.created_at else None,
    }


def _errors(fields: SubscriptionFields, channel: str) -> list[dict[str, str]]:
    errors: list[dict[str, str]] = []

    def bad(field: str, message: str) -> None:
        errors.append({"field": field, "message": message})

    name = fields.get("name", "x")
    if not isinstance(name, str) or not name.strip() or len(name) > 100 or "\x00" in name:
        bad("name", "1 to 100 characters")
    target = fields.get("target", EVERYONE)
    if not isinstance(target, str) or not (target == EVERYONE or _GROUP.match(target)):
        bad("target", "a group's name, or * for everyone")
    types = fields.get("event_types", [])
    if not isinstance(types, list) or any(t not in NOTIFICATION_TYPES for t in types):
        bad("event_types", f"a list of: {', '.join(NOTIFICATION_TYPES)}")
    for field, limit in (("kind", 64), ("name_prefix", 255)):
        value = fields.get(field, "")
        if not isinstance(value, str) or len(value) > limit or "\x00" in value:
            bad(field, f"at most {limit} characters")
    if channel not in Channel.values:
        bad("channel", f"one of {', '.join(Channel.values)}")
    return errors


def _check_url(channel: str, url: str) -> str:
    """The URL's problem for this channel, "" when fine (a refused address raises)."""
    if channel == Channel.EMAIL:
        return "email subscriptions have no URL" if url else ""
    if not url:
        return "required for this channel"
    if len(url) > 2000 or "\x00" in url:
        return "at most 2000 characters"
    if channel == Channel.WEBHOOK:
        webhook_url_check(url)  # raises UrlRefused (422 webhook_url_refused)
        return ""
    return apprise_url_problem(url)


def _display(channel: str, url: str) -> str:
    """What the API, the console and the audit trail may show of the URL."""
    if not url:
        return ""
    return apprise_url_display(url) if channel == Channel.APPRISE else url_display(url)


def _raise(errors: list[dict[str, str]]) -> None:
    if errors:
        raise ValidationFailed(
            "; ".join(f"{e['field']}: {e['message']}" for e in errors), extra={"errors": errors}
        )


def subscription_create(*, actor: Actor, **fields: Unpack[SubscriptionFields]) -> Created:
    """Create a subscription (admins). A webhook gets a new signing secret, returned once.
    Raises Forbidden, ValidationFailed (UrlRefused for a refused webhook address)."""
    person = require_person(actor, is_admin, _ADMINS_ONLY)
    channel = str(fields.get("channel", ""))
    errors = _errors(fields, channel)
    url = str(fields.get("url", "") or "")
    if not errors:
        problem = _check_url(channel, url)
        errors = [{"field": "url", "message": problem}] if problem else []
    _raise(errors)
    secret = webhook_secret_new() if channel == Channel.WEBHOOK else ""
    with transaction.atomic():
        subscription = Subscription.objects.create(
            name=fields["name"].strip(),
            target=fields.get("target", EVERYONE),
            event_types=[t for t in NOTIFICATION_TYPES if t in fields.get("event_types", [])],
            kind=fields.get("kind", ""),
            name_prefix=fields.get("name_prefix", ""),
            channel=channel,
            url_encrypted=seal(url),
            url_display=_display(channel, url),
            secret_encrypted=seal(secret),
            paused=bool(fields.get("paused", False)),
            created_by=person,
        )
        audit_append(
            event_type="notification_subscription.created",
            actor=actor,
            details=subscription_as_dict(subscription),
        )
    return Created(subscription, secret)


def _locked(subscription_id: int) -> Subscription:
    subscription = (
        Subscription.objects.select_for_update(of=("self",))
        .select_related("created_by")
        .filter(pk=subscription_id)
        .first()
    )
    if subscription is None:
        raise NotFound(f"No notification subscription {subscription_id}.")
    return subscription


def subscription_update(
    *, actor: Actor, subscription_id: int, **fields: Unpack[SubscriptionFields]
) -> tuple[Subscription, bool]:
    """Change the given fields (admins); resuming (`paused: false`) also clears a 410's
    disabling. Returns (subscription, changed): no change, no audit row.
    Raises Forbidden, NotFound, ValidationFailed."""
    require_person(actor, is_admin, _ADMINS_ONLY)
    with transaction.atomic():
        subscription = _locked(subscription_id)
        if "channel" in fields and fields["channel"] != subscription.channel:
            _raise([{"field": "channel", "message": "cannot change: create a new subscription"}])
        _raise(_errors(fields, subscription.channel))
        before = subscription_as_dict(subscription)
        for field in ("name", "target", "kind", "name_prefix", "paused"):
            if field in fields:
                value: Any = fields[field]
                setattr(subscription, field, value.strip() if field == "name" else value)
        if "event_types" in fields:
            wanted = fields["event_types"]
            subscription.event_types = [t for t in NOTIFICATION_TYPES if t in wanted]
        url_changed = "url" in fields
        if url_changed:
            url = str(fields.get("url") or "")
            problem = _check_url(subscription.channel, url)
            _raise([{"field": "url", "message": problem}] if problem else [])
            subscription.url_encrypted = seal(url)
            subscription.url_display = _display(subscription.channel, url)
        if fields.get("paused") is False and subscription.disabled_at is not None:
            subscription.disabled_at, subscription.disabled_reason = None, ""
        after = subscription_as_dict(subscription)
        if after == before and not url_changed:
            return subscription, False
        subscription.save()
        changed = {k: {"from": before[k], "to": after[k]} for k in after if before[k] != after[k]}
        if url_changed:
            changed["url"] = {"from": before["url"], "to": after["url"], "replaced": True}
        audit_append(
            event_type="notification_subscription.updated",
            actor=actor,
            details={"id": subscription.pk, "changed": changed},
        )
    return subscription, True


def subscription_delete(*, actor: Actor, subscription_id: int) -> bool:
    """Delete a subscription and its delivery log (admins). False when it was already
    gone (no second audit row). Raises Forbidden."""
    require_person(actor, is_admin, _ADMINS_ONLY)
    with transaction.atomic():
        subscription = Subscription.objects.select_for_update().filter(pk=subscription_id).first()
        if subscription is None:
            return False
        details = subscription_as_dict(subscription)
        subscription.delete()
        audit_append(event_type="notification_subscription.deleted", actor=actor, details=details)
    return True


def subscription_secret_rotate(*, actor: Actor, subscription_id: int) -> Created:
    """A new webhook secret, returned once; the old one keeps signing beside it for
    AIRLOCK_WEBHOOK_SECRET_OVERLAP_SECONDS. Raises Forbidden, NotFound, InvalidTransition
    (409: not a webhook)."""
    require_person(actor, is_admin, _ADMINS_ONLY)
    secret = webhook_secret_new()
    overlap = timedelta(seconds=int(settings.AIRLOCK_WEBHOOK_SECRET_OVERLAP_SECONDS))
    with transaction.atomic():
        subscription = _locked(subscription_id)
        if subscription.channel != Channel.WEBHOOK:
            raise InvalidTransition(
                f"Subscription {subscription_id} is not a webhook: it has no signing secret."
            )
        subscription.previous_secret_encrypted = subscription.secret_encrypted
        subscription.previous_secret_until = timezone.now() + overlap
        subscription.secret_encrypted = seal(secret)
        subscription.save()
        audit_append(
            event_type="notification_subscription.secret_rotated",
            actor=actor,
            details={"id": subscription.pk, "old_secret_signs_until": _iso_until(subscription)},
        )
    return Created(subscription, secret)


def _iso_until(subscription: Subscription) -> str | None:
    until = subscription.previous_secret_until
    return until.isoformat() if until else None


def subscription_test(*, actor: Actor, subscription_id: int) -> Delivery:
    """Send a `test` notification to this subscription only (a paused or disabled one
    records it as `disabled`, unsent). Returns its delivery. Raises Forbidden, NotFound."""
    require_person(actor, is_admin, _ADMINS_ONLY)
    with transaction.atomic():
        subscription = _locked(subscription_id)
        facts = Facts(
            "test",
            {"subscription": subscription.pk, "by": actor.label, "link": deep_link("/")},
            frozenset(),
        )
        notification_id = notification_record(facts, [Listener.of(subscription)], matched=True)
        assert notification_id is not None
        audit_append(
            event_type="notification_subscription.tested",
            actor=actor,
            details={"id": subscription.pk, "notification": str(notification_id)},
        )
        return Delivery.objects.select_related("notification").get(notification_id=notification_id)
