"""`manage.py person_create USERNAME --role operator|owner|admin|auditor
[--group G]... [--password P]`: create (or update) a person and print a new
personal token (pt_…) as the last line."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from approvals.services.tokens import personal_token_create
from audit.services import Actor, audit_append
from console.permissions import ROLES


class Command(BaseCommand):
    help = "Create a person with a role (and groups) and print a personal token (last line)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--role", required=True, choices=sorted(ROLES))
        parser.add_argument(
            "--group", action="append", default=[], help="an owner group; repeatable"
        )
        parser.add_argument("--password", help="console sign-in password (none: API only)")
        parser.add_argument("--email", default="")

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["username"].strip()
        if not username or len(username) > 150:
            raise CommandError("USERNAME must be 1..150 characters.")
        groups = [ROLES[options["role"]], *options["group"]]
        for group in groups:
            if not group.replace("-", "").replace("_", "").replace(".", "").isalnum():
                raise CommandError(f"Bad group name {group!r}.")
        actor = Actor.system("manage.py person_create")
        with transaction.atomic():
            user, created = get_user_model().objects.get_or_create(
                username=username, defaults={"email": options["email"]}
            )
            if options.get("password"):
                user.set_password(options["password"])
            elif created:
                user.set_unusable_password()
            user.save()
            for name in groups:
                group, _ = Group.objects.get_or_create(name=name)
                user.groups.add(group)
            audit_append(
                event_type="person.created" if created else "person.updated",
                actor=actor,
                details={"username": username, "groups": groups},
            )
        _, secret = personal_token_create(user=user, actor=actor, label="cli")
        verb = "created" if created else "updated"
        self.stdout.write(f"Person {username} {verb} with groups {', '.join(groups)}. Token:")
        self.stdout.write(secret)
