"""`manage.py person_create USERNAME --role operator|owner|admin|auditor
[--role …] [--group G]... [--password P] [--new-token]`: create a person through
the people service (the People page's validation and audit) and print a new
personal token (pt_…) as the last line."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError, CommandParser
from django.db import transaction

from approvals.services.tokens import personal_token_create
from audit.services import Actor
from console.management import PrincipalCommand
from console.people import person_create
from console.permissions import ROLES
from engine.core.errors import DomainError


class Command(PrincipalCommand):
    help = "Create a person with roles (and owner groups) and print a personal token (last line)."
    principal = "person"
    token = "personal token"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument(
            "--role", action="append", required=True, choices=sorted(ROLES), help="repeatable"
        )
        parser.add_argument(
            "--group", action="append", default=[], help="an owner group; repeatable"
        )
        parser.add_argument("--password", help="console sign-in password (none: API only)")
        parser.add_argument("--email", default="")
        super().add_arguments(parser)

    def existing(self, options: dict[str, Any]) -> tuple[str, Any]:
        username = options["username"].strip()
        return username, get_user_model().objects.filter(username=username).first()

    def another_token(self, existing: Any, actor: Actor) -> str:
        return personal_token_create(user=existing, actor=actor, label="cli")[1]

    def create(self, options: dict[str, Any], actor: Actor, *, exists: bool) -> tuple[str, str]:
        username = options["username"].strip()
        try:
            # One transaction: a person is never left without the token printed for them.
            with transaction.atomic():
                person = person_create(
                    user=actor,
                    username=username,
                    password=options.get("password"),
                    roles=options["role"],
                    groups=options["group"],
                    email=options["email"],
                )
                _, secret = personal_token_create(user=person, actor=actor, label="cli")
        except DomainError as exc:
            raise CommandError(exc.message) from exc
        roles = ", ".join(sorted(options["role"]))
        return f"Person {username} created ({roles}). Token:", secret
