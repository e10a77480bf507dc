"""The person behind an acting principal (audit.services.Actor).

Services take `actor: Actor`; those whose rule depends on who the person is
(their groups, whether they own the agent) load the user here.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser

from audit.models import ActorType
from audit.services import Actor


def person_id(actor: Actor) -> int | None:
    """The user id of a person actor (None for the system, agents and runs)."""
    if actor.type != ActorType.PERSON or not actor.id.isdigit():
        return None
    return int(actor.id)


def acting_person(actor: Actor) -> AbstractBaseUser | None:
    """The active user behind a person actor; None for anyone else."""
    user_id = person_id(actor)
    if user_id is None:
        return None
    return get_user_model().objects.filter(pk=user_id, is_active=True).first()
