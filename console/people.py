"""People: admins create console users, change their roles and owner groups,
deactivate and reactivate them. Roles and owner groups are Django groups
(`console.permissions`); every change is audited in its own transaction.

The People page, `manage.py person_create` and the demo all create people
through `person_create`; passwords go through Django's validators and never
reach the audit details.
"""

from __future__ import annotations

import re
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from audit.models import ActorType
from audit.services import Actor, audit_append
from console.permissions import ROLES, is_admin
from engine.core.errors import Forbidden, NotFound, ValidationFailed

GROUP_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,150}$")
USERNAME_PATTERN = re.compile(r"^[\w.@+-]{1,150}$")
ROLE_GROUPS = frozenset(ROLES.values())
MIN_PASSWORD_LENGTH = 12


def _require_admin(user: Any) -> None:
    if not getattr(user, "is_active", False) or not is_admin(user):
        raise Forbidden("Only admins manage people.")


def _admin_actor(user: Any) -> Actor:
    """The audit actor of an admin, or the system actor a management command passes."""
    if isinstance(user, Actor):
        if user.type != ActorType.SYSTEM:
            raise Forbidden("Only admins manage people.")
        return user
    _require_admin(user)
    return Actor.person(user)


def _invalid(errors: list[dict[str, str]]) -> ValidationFailed:
    return ValidationFailed(
        "; ".join(f"{e['field']}: {e['message']}" for e in errors), extra={"errors": errors}
    )


def _check_roles_and_groups(
    roles: list[str], groups: list[str], errors: list[dict[str, str]]
) -> None:
    if not roles or any(role not in ROLES for role in roles):
        errors.append({"field": "roles", "message": f"one or more of {', '.join(sorted(ROLES))}"})
    bad = [g for g in groups if not GROUP_PATTERN.match(g) or g in ROLE_GROUPS]
    if bad:
        errors.append(
            {
                "field": "groups",
                "message": f"bad owner group name(s): {', '.join(bad)} "
                "(letters, digits, . _ -; not a role group)",
            }
        )


def _check_password(password: str, person: Any, errors: list[dict[str, str]]) -> None:
    # The settings configure no AUTH_PASSWORD_VALIDATORS: a length floor here,
    # plus whatever validators a deployment adds.
    if len(password) < MIN_PASSWORD_LENGTH:
        message = f"too short: at least {MIN_PASSWORD_LENGTH} characters"
        errors.append({"field": "password", "message": message})
        return
    try:
        validate_password(password, user=person)
    except ValidationError as exc:
        errors.append({"field": "password", "message": " ".join(exc.messages)})


def person_groups(person: Any) -> tuple[list[str], list[str]]:
    """(roles, owner groups) of a person, each sorted."""
    by_group = {group: role for role, group in ROLES.items()}
    names = sorted(person.groups.values_list("name", flat=True))
    return (
        sorted(by_group[n] for n in names if n in by_group),
        [n for n in names if n not in by_group],
    )


def _set_groups(person: Any, names: list[str]) -> None:
    groups = []
    for name in names:
        group, _ = Group.objects.get_or_create(name=name)
        groups.append(group)
    person.groups.set(groups)


def person_create(
    *,
    user: Any,
    username: str,
    password: str | None,
    roles: list[str],
    groups: list[str] | None = None,
    email: str = "",
) -> Any:
    """Create an active person (admins only, or `Actor.system(...)` from a
    management command). `password=None`: no console sign-in (API tokens only).

    Raises Forbidden, ValidationFailed (bad name, taken name, weak password,
    unknown role, bad group name).
    """
    actor = _admin_actor(user)
    groups = sorted(set(groups or []))
    roles = sorted(set(roles))
    username = (username or "").strip()
    errors: list[dict[str, str]] = []
    model = get_user_model()
    if not USERNAME_PATTERN.match(username):
        errors.append({"field": "username", "message": "1..150 letters, digits and @.+-_"})
    elif model.objects.filter(username=username).exists():
        errors.append({"field": "username", "message": f"{username} already exists"})
    if password is not None:  # None: API only, create_user makes it unusable
        _check_password(password, model(username=username), errors)
    _check_roles_and_groups(roles, groups, errors)
    if errors:
        raise _invalid(errors)
    try:
        with transaction.atomic():
            person = model.objects.create_user(username=username, password=password, email=email)
            _set_groups(person, [ROLES[r] for r in roles] + groups)
            audit_append(
                event_type="person.created",
                actor=actor,
                details={"username": username, "roles": roles, "groups": groups},
            )
    except IntegrityError as exc:
        # Two admins racing for the same name: the unique constraint decides.
        raise _invalid([{"field": "username", "message": f"{username} already exists"}]) from exc
    return person


def _locked_person(person_id: int) -> Any:
    person = get_user_model().objects.select_for_update().filter(pk=person_id).first()
    if person is None:
        raise NotFound("No such person.")
    return person


def person_update(
    *, user: Any, person_id: int, roles: list[str], groups: list[str] | None = None
) -> tuple[Any, bool]:
    """Replace a person's roles and owner groups (admins only). The row is locked
    so concurrent edits serialise. Returns (person, changed): no change, no audit row.

    An admin cannot remove their own admin role (the last way back in).
    Raises Forbidden, NotFound, ValidationFailed.
    """
    _require_admin(user)
    groups = sorted(set(groups or []))
    roles = sorted(set(roles))
    errors: list[dict[str, str]] = []
    _check_roles_and_groups(roles, groups, errors)
    if person_id == user.pk and "admin" not in roles and not user.is_superuser:
        errors.append({"field": "roles", "message": "you cannot remove your own admin role"})
    if errors:
        raise _invalid(errors)
    with transaction.atomic():
        person = _locked_person(person_id)
        before_roles, before_groups = person_groups(person)
        if (before_roles, before_groups) == (roles, groups):
            return person, False
        _set_groups(person, [ROLES[r] for r in roles] + groups)
        audit_append(
            event_type="person.updated",
            actor=Actor.person(user),
            details={
                "username": person.get_username(),
                "roles": {"from": before_roles, "to": roles},
                "groups": {"from": before_groups, "to": groups},
            },
        )
    person._airlock_groups = None  # the cached group names are stale now
    return person, True


def person_set_active(*, user: Any, person_id: int, active: bool) -> tuple[Any, bool]:
    """Deactivate (or reactivate) a person (admins only): a deactivated person
    cannot sign in and their personal tokens stop resolving. Conditional UPDATE:
    repeating it is a no-op without an audit row. Returns (person, changed).
    Raises Forbidden, NotFound, ValidationFailed (deactivating yourself).
    """
    _require_admin(user)
    if person_id == user.pk and not active:
        raise _invalid([{"field": "person", "message": "you cannot deactivate yourself"}])
    model = get_user_model()
    with transaction.atomic():
        changed = model.objects.filter(pk=person_id, is_active=not active).update(is_active=active)
        person = model.objects.filter(pk=person_id).first()
        if person is None:
            raise NotFound("No such person.")
        if changed:
            audit_append(
                event_type="person.activated" if active else "person.deactivated",
                actor=Actor.person(user),
                details={"username": person.get_username()},
            )
    return person, bool(changed)
