"""API: notification subscriptions and their delivery log (admins only; writes audited).

A webhook's signing secret is in the answer of the create and of rotate-secret, once;
no other answer, log or audit event carries it.
"""

# ninja's Query()/Path() defaults read as unparameterised generics to mypy.
# mypy: disable-error-code="type-arg"

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from django.http import HttpRequest, HttpResponse
from ninja import Field, Path, Query, Router, Schema
from pydantic import BeforeValidator, ConfigDict

from console.api_support import (
    NEWEST_FIRST,
    RoleBearer,
    json_bool,
    json_response,
    page_response,
    writing_principal,
)
from console.permissions import is_admin
from console.problems import errors
from engine.core.errors import NotFound
from notifications.selectors import (
    delivery_as_dict,
    delivery_list,
    subscription_get,
    subscription_list,
)
from notifications.services import subscriptions as services
from notifications.services.events import NOTIFICATION_TYPES
from notifications.services.subscriptions import subscription_as_dict

router = Router(tags=["notifications"])
admin_token = RoleBearer(is_admin, "Only admins manage notification subscriptions.")

_MAX_ID = 2**63 - 1
_SUBSCRIPTION_ID = Path(..., ge=1, le=_MAX_ID)
EventType = Literal[NOTIFICATION_TYPES]  # type: ignore[valid-type]
_GROUP_PATTERN = r"^(\*|[A-Za-z0-9_.@+-]{1,150})$"
_TEXT = r"^[^\x00]*$"
JsonBool = Annotated[bool, BeforeValidator(json_bool)]


class SubscriptionOut(Schema):
    id: int
    name: str
    target: str
    event_types: list[str]
    kind: str
    name_prefix: str
    channel: str
    url: str = Field(description="Scheme and host only: the URL itself is a secret")
    paused: bool
    disabled_at: str | None
    disabled_reason: str
    secret_rotating_until: str | None
    created_by: str | None
    created_at: str | None


class SubscriptionCreatedOut(SubscriptionOut):
    secret: str | None = Field(
        None, description="The webhook signing secret (whsec_…): shown this once"
    )


class SubscriptionPage(Schema):
    items: list[SubscriptionOut]


class SubscriptionIn(Schema):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=100, pattern=r"^[^\x00]*\S[^\x00]*$")
    target: str = Field("*", pattern=_GROUP_PATTERN, description="A group's name, or `*`")
    event_types: list[EventType] = Field(default_factory=list, max_length=32)
    kind: str = Field("", max_length=64, pattern=_TEXT)
    name_prefix: str = Field("", max_length=255, pattern=_TEXT)
    channel: Literal["webhook", "apprise", "email"]
    url: str = Field("", max_length=2000, pattern=_TEXT, description="Webhook or Apprise URL")
    paused: JsonBool = False


class SubscriptionPatch(Schema):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[^\x00]*\S[^\x00]*$")
    target: str | None = Field(None, pattern=_GROUP_PATTERN)
    event_types: list[EventType] | None = Field(None, max_length=32)
    kind: str | None = Field(None, max_length=64, pattern=_TEXT)
    name_prefix: str | None = Field(None, max_length=255, pattern=_TEXT)
    url: str | None = Field(None, max_length=2000, pattern=_TEXT)
    paused: JsonBool | None = None


class AttemptOut(Schema):
    number: int
    started_at: str
    status_code: int | None
    latency_ms: int
    response_excerpt: str
    error: str


class DeliveryOut(Schema):
    id: uuid.UUID
    subscription: int
    notification: uuid.UUID
    event: str
    webhook_id: str
    status: str
    attempts: int
    created_at: str
    next_attempt_at: str | None
    finished_at: str | None
    last_error: str
    attempt_log: list[AttemptOut]


class DeliveryPage(Schema):
    items: list[DeliveryOut]
    next: str | None


def _created(created: services.Created, status: int) -> HttpResponse:
    body: dict[str, Any] = subscription_as_dict(created.subscription)
    body["secret"] = created.secret or None
    return json_response(
        body,
        status=status,
        headers={
            "Location": f"/api/v1/subscriptions/{created.subscription.pk}",
            "Cache-Control": "no-store",
        },
    )


@router.get(
    "/subscriptions",
    auth=admin_token,
    response={200: SubscriptionPage, **errors(401, 403)},
    summary="Notification subscriptions (admins)",
)
def subscriptions_get(request: HttpRequest) -> HttpResponse:
    return json_response({"items": [subscription_as_dict(s) for s in subscription_list()]})


@router.post(
    "/subscriptions",
    auth=admin_token,
    response={201: SubscriptionCreatedOut, **errors(400, 401, 403, 413, 422, 429)},
    summary="Create a subscription (admins; audited). A webhook's secret is in this answer only",
)
def subscription_post(request: HttpRequest, payload: SubscriptionIn) -> HttpResponse:
    principal = writing_principal(request)
    created = services.subscription_create(actor=principal.actor, **payload.model_dump())
    return _created(created, 201)


@router.get(
    "/subscriptions/{subscription_id}",
    auth=admin_token,
    response={200: SubscriptionOut, **errors(401, 403, 404, 422)},
    summary="One subscription (admins)",
)
def subscription_detail(
    request: HttpRequest, subscription_id: int = _SUBSCRIPTION_ID
) -> HttpResponse:
    return json_response(subscription_as_dict(subscription_get(subscription_id)))


@router.patch(
    "/subscriptions/{subscription_id}",
    auth=admin_token,
    response={200: SubscriptionOut, **errors(400, 401, 403, 404, 413, 422, 429)},
    summary="Change a subscription: pause, resume, filters, URL (admins; audited when changed)",
)
def subscription_patch(
    request: HttpRequest, payload: SubscriptionPatch, subscription_id: int = _SUBSCRIPTION_ID
) -> HttpResponse:
    principal = writing_principal(request)
    fields = {k: v for k, v in payload.model_dump().items() if v is not None}
    subscription, _ = services.subscription_update(
        actor=principal.actor, subscription_id=subscription_id, **fields
    )
    return json_response(subscription_as_dict(subscription))


@router.delete(
    "/subscriptions/{subscription_id}",
    auth=admin_token,
    response={204: None, **errors(401, 403, 404, 422, 429)},
    summary="Delete a subscription and its delivery log (admins; audited)",
)
def subscription_delete(
    request: HttpRequest, subscription_id: int = _SUBSCRIPTION_ID
) -> HttpResponse:
    principal = writing_principal(request)
    if not services.subscription_delete(actor=principal.actor, subscription_id=subscription_id):
        raise NotFound(f"No notification subscription {subscription_id}.")
    return HttpResponse(status=204)


@router.post(
    "/subscriptions/{subscription_id}/test",
    auth=admin_token,
    response={202: DeliveryOut, **errors(401, 403, 404, 422, 429)},
    summary="Send a test event to this subscription (admins; audited)",
)
def subscription_test(
    request: HttpRequest, subscription_id: int = _SUBSCRIPTION_ID
) -> HttpResponse:
    principal = writing_principal(request)
    delivery = services.subscription_test(actor=principal.actor, subscription_id=subscription_id)
    return json_response(delivery_as_dict(delivery), status=202)


@router.post(
    "/subscriptions/{subscription_id}/rotate-secret",
    auth=admin_token,
    response={200: SubscriptionCreatedOut, **errors(401, 403, 404, 409, 422, 429)},
    summary="A new webhook secret, shown once; the old one signs too for the overlap window",
)
def subscription_rotate_secret(
    request: HttpRequest, subscription_id: int = _SUBSCRIPTION_ID
) -> HttpResponse:
    principal = writing_principal(request)
    created = services.subscription_secret_rotate(
        actor=principal.actor, subscription_id=subscription_id
    )
    return _created(created, 200)


@router.get(
    "/deliveries",
    auth=admin_token,
    response={200: DeliveryPage, **errors(400, 401, 403, 422)},
    summary="The delivery log, newest first, with each attempt (admins)",
)
def deliveries(
    request: HttpRequest,
    subscription: int | None = Query(None, ge=1, le=_MAX_ID),
    status: Literal["pending", "delivered", "failed", "disabled"] | None = None,
    event: EventType | None = None,
    limit: int = Query(50, ge=1, le=200),
    cursor: str | None = Query(None, pattern=r"^[0-9]{1,16}\.[0-9a-f]{32}$"),
) -> HttpResponse:
    rows = delivery_list(subscription=subscription, status=status, event=event)
    return page_response(
        rows, keyset=NEWEST_FIRST, cursor=cursor, limit=limit, render=delivery_as_dict
    )
