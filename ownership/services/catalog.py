"""The conflict-class table and resource kinds: admin-only edits, audited.

The API (`PUT /conflict-classes/{slug}`, `PUT /resource-kinds/{kind}`), the
console and the bench fixtures call these same functions.
"""

from __future__ import annotations

import re
from typing import Any

from django.db import transaction

from audit.services import Actor, audit_append
from console.permissions import is_admin
from engine.core.actors import acting_person
from engine.core.errors import Forbidden, ValidationFailed
from engine.targets.base import TargetConfigError, TargetError, WeakValidator
from ownership.models import ApprovalMode, ConflictClass, OnConflict, ResourceKind, TargetType
from ownership.targets import adapter_for_kind, adapter_for_settings

SLUG_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
RESOLVER_PATTERN = re.compile(r"^(agent|owner|group:[A-Za-z0-9._-]{1,140})$")
GROUP_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,150}$")

CLASS_FIELDS = (
    "name",
    "description",
    "approval_mode",
    "on_conflict",
    "resolver",
    "quorum",
    "undo_window_seconds",
    "approval_ttl_seconds",
    "escalation_seconds",
    "escalation_group",
    "forbid_agent_owner_approval",
    "grants_allowed",
)


def _require_admin(actor: Actor) -> None:
    person = acting_person(actor)
    if person is None or not is_admin(person):
        raise Forbidden("Only admins edit the conflict-class table and resource kinds.")


def _invalid(errors: list[dict[str, str]]) -> ValidationFailed:
    return ValidationFailed(
        "; ".join(f"{e['field']}: {e['message']}" for e in errors), extra={"errors": errors}
    )


def _read_only_contradictions(
    data: dict[str, Any], *, slug_field: str, slug: str
) -> list[dict[str, str]]:
    """The representation GET returned may be sent back as it is (GET -> edit -> PUT):
    its read-only identifier must name this slug; `updated_at` is stamped by the
    server and ignored."""
    given = data.get(slug_field)
    if given is None or given == slug:
        return []
    return [
        {
            "field": slug_field,
            "message": f"read-only: {given!r} contradicts the path's {slug!r} (omit it or "
            "send the same value)",
        }
    ]


def conflict_class_as_dict(klass: ConflictClass) -> dict[str, Any]:
    return {
        "slug": klass.slug,
        **{name: getattr(klass, name) for name in CLASS_FIELDS},
        "retryable_by_agent": klass.retryable_by_agent,
        "updated_at": klass.updated_at.isoformat(),
    }


def resource_kind_as_dict(kind: ResourceKind) -> dict[str, Any]:
    return {
        "kind": kind.slug,
        "description": kind.description,
        "classes": {
            "create": kind.class_create_id,
            "update": kind.class_update_id,
            "delete": kind.class_delete_id,
        },
        "owner_group": kind.owner_group,
        "undo_window_seconds": kind.undo_window_seconds,
        "target": kind.target,
        "target_url": kind.target_url,
        "target_settings": kind.target_settings,
        "capabilities": kind_capabilities(kind),
        "updated_at": kind.updated_at.isoformat(),
    }


def conflict_class_save(
    *, slug: str, data: dict[str, Any], actor: Actor
) -> tuple[ConflictClass, bool]:
    """Create or replace a conflict class (admins only). Returns (class, created).

    Raises Forbidden, ValidationFailed (422 with per-field errors).
    """
    _require_admin(actor)
    errors: list[dict[str, str]] = []
    if not SLUG_PATTERN.match(slug):
        errors.append({"field": "slug", "message": "must be a lowercase slug"})
    errors.extend(_read_only_contradictions(data, slug_field="slug", slug=slug))
    derived_retryable = data.get("resolver") == "agent"
    if data.get("retryable_by_agent") not in (None, derived_retryable):
        errors.append(
            {
                "field": "retryable_by_agent",
                "message": f"read-only, derived from resolver: {str(derived_retryable).lower()} "
                f"for resolver {data.get('resolver')!r}",
            }
        )
    if data.get("approval_mode") not in ApprovalMode.values:
        errors.append({"field": "approval_mode", "message": "must be per_run or per_call"})
    if data.get("on_conflict") not in OnConflict.values:
        errors.append(
            {"field": "on_conflict", "message": f"must be one of {', '.join(OnConflict.values)}"}
        )
    if not isinstance(data.get("resolver"), str) or not RESOLVER_PATTERN.match(data["resolver"]):
        errors.append({"field": "resolver", "message": "must be agent, owner or group:<name>"})
    name = data.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        errors.append({"field": "name", "message": "required, at most 200 characters"})
    for field, low, high in (
        ("quorum", 1, 20),
        ("undo_window_seconds", 0, 30 * 86400),
        ("approval_ttl_seconds", 60, 30 * 86400),
        ("escalation_seconds", 0, 30 * 86400),
    ):
        value = data.get(field)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high
        ):
            errors.append({"field": field, "message": f"must be an integer in [{low}, {high}]"})
    if errors:
        raise _invalid(errors)
    values = {
        "name": name,
        "description": data.get("description") or "",
        "approval_mode": data["approval_mode"],
        "on_conflict": data["on_conflict"],
        "resolver": data["resolver"],
        "quorum": data.get("quorum") or 1,
        "undo_window_seconds": data.get("undo_window_seconds", 600),
        "approval_ttl_seconds": data.get("approval_ttl_seconds") or 172_800,
        "escalation_seconds": data.get("escalation_seconds") or 0,
        "escalation_group": data.get("escalation_group") or "",
        "forbid_agent_owner_approval": bool(data.get("forbid_agent_owner_approval", True)),
        "grants_allowed": bool(data.get("grants_allowed", True)),
    }
    with transaction.atomic():
        klass, created = ConflictClass.objects.update_or_create(slug=slug, defaults=values)
        audit_append(
            event_type="conflict_class.created" if created else "conflict_class.replaced",
            actor=actor,
            details={"slug": slug, **{k: values[k] for k in CLASS_FIELDS}},
        )
    return klass, created


def resource_kind_save(
    *, slug: str, data: dict[str, Any], actor: Actor
) -> tuple[ResourceKind, bool]:
    """Create or replace a resource kind (admins only). Returns (kind, created)."""
    _require_admin(actor)
    errors: list[dict[str, str]] = []
    if not SLUG_PATTERN.match(slug):
        errors.append({"field": "kind", "message": "must be a lowercase slug"})
    errors.extend(_read_only_contradictions(data, slug_field="kind", slug=slug))
    classes = data.get("classes")
    existing = set(ConflictClass.objects.values_list("slug", flat=True))
    if not isinstance(classes, dict):
        errors.append({"field": "classes", "message": "must map create, update, delete to classes"})
        classes = {}
    for operation in ("create", "update", "delete"):
        value = classes.get(operation)
        if value not in existing:
            errors.append(
                {"field": f"classes.{operation}", "message": "must name an existing conflict class"}
            )
    extra_ops = set(classes) - {"create", "update", "delete"}
    if extra_ops:
        errors.append({"field": "classes", "message": f"unknown operations {sorted(extra_ops)}"})
    owner_group = data.get("owner_group")
    if not isinstance(owner_group, str) or not GROUP_PATTERN.match(owner_group):
        errors.append({"field": "owner_group", "message": "required, a group name"})
    window = data.get("undo_window_seconds")
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or not 0 <= window <= 30 * 86400
    ):
        errors.append({"field": "undo_window_seconds", "message": "null or 0..2592000"})
    target = data.get("target") or TargetType.MANAGED
    target_url = data.get("target_url") or ""
    target_settings = data.get("target_settings")
    if target_settings is None:
        # A form that does not show the settings (the console's) keeps the stored ones.
        stored = ResourceKind.objects.filter(slug=slug, target=target).first()
        target_settings = stored.target_settings if stored is not None else {}
    if target not in TargetType.values:
        errors.append({"field": "target", "message": "must be managed, http, postgres or git"})
    elif target == TargetType.HTTP and not str(target_url).startswith(("http://", "https://")):
        errors.append({"field": "target_url", "message": "required for http targets"})
    elif not isinstance(target_settings, dict):
        errors.append({"field": "target_settings", "message": "an object"})
    elif target == TargetType.MANAGED and target_settings:
        errors.append({"field": "target_settings", "message": "a managed kind has none"})
    elif target != TargetType.MANAGED:
        errors += _target_errors(target, target_url, target_settings, data.get("probe_resource"))
    if errors:
        raise _invalid(errors)
    values = {
        "description": data.get("description") or "",
        "class_create_id": classes["create"],
        "class_update_id": classes["update"],
        "class_delete_id": classes["delete"],
        "owner_group": owner_group,
        "undo_window_seconds": window,
        "target": target,
        "target_url": target_url,
        "target_settings": target_settings,
    }
    with transaction.atomic():
        kind, created = ResourceKind.objects.update_or_create(slug=slug, defaults=values)
        audit_append(
            event_type="resource_kind.created" if created else "resource_kind.replaced",
            actor=actor,
            details={
                "kind": slug,
                "classes": dict(classes),
                "owner_group": owner_group,
                "undo_window_seconds": window,
                "target": target,
                # Names only: a kind's settings can hold no credential (an adapter refuses
                # unknown settings; `credentials_env` names an environment variable).
                "target_settings": target_settings,
            },
        )
    return kind, created


def kind_capabilities(kind: ResourceKind) -> dict[str, bool]:
    """What the kind's target enforces itself (Airlock's own store: both)."""
    if kind.target == TargetType.MANAGED:
        return {"holds_fence": True, "takes_idempotency_key": True}
    try:
        capabilities = adapter_for_kind(kind).capabilities
    except TargetConfigError:
        return {"holds_fence": False, "takes_idempotency_key": False}
    return {
        "holds_fence": capabilities.holds_fence,
        "takes_idempotency_key": capabilities.takes_idempotency_key,
    }


def _target_errors(
    target: str, target_url: str, target_settings: dict[str, Any], probe: Any
) -> list[dict[str, str]]:
    """The settings checked by the adapter that will use them; with `probe_resource`, one
    document read once, so a target handing out weak or no validators is refused now."""
    try:
        adapter = adapter_for_settings(target, target_url, target_settings)
    except TargetConfigError as exc:
        return [{"field": "target_settings", "message": str(exc)}]
    if probe is None:
        return []
    if not isinstance(probe, str) or not probe:
        return [{"field": "probe_resource", "message": "a resource name"}]
    try:
        adapter.read(probe)
    except WeakValidator as exc:
        return [{"field": "probe_resource", "message": f"refused: {exc}"}]
    except TargetError as exc:
        return [{"field": "probe_resource", "message": f"could not be read: {exc}"}]
    return []
