"""`manage.py person_create USERNAME --role operator|owner|admin|auditor
[--role …] [--group G]... [--password P] [--new-token]`: create a person through
the people service (the People page's validation and audit) and print a new
personal token (pt_…) as the last line."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from approvals.services.tokens import personal_token_create
from audit.services import Actor
from console.core.errors import DomainError
from console.people import person_create
from console.permissions import ROLES


class Command(BaseCommand):
    help = "Create a person with roles (and owner groups) and print a personal token (last line)."

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
        parser.add_argument(
            "--new-token",
            action="store_true",
            help="if the person exists, issue another personal token instead of failing",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        actor = Actor.system("manage.py person_create")
        username = options["username"].strip()
        existing = get_user_model().objects.filter(username=username).first()
        if existing is not None and options["new_token"]:
            _, secret = personal_token_create(user=existing, actor=actor, label="cli")
            self.stdout.write(f"New personal token for {username}:")
            self.stdout.write(secret)
            return
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
        self.stdout.write(f"Person {username} created ({roles}). Token:")
        self.stdout.write(secret)
