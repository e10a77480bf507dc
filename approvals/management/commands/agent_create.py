"""`manage.py agent_create NAME [--owner USERNAME]`: register an agent and print
its first token (ak_…) as the last line."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.text import slugify

from approvals.models import Agent
from approvals.services.tokens import agent_create, agent_token_create
from audit.services import Actor


class Command(BaseCommand):
    help = "Register an agent and print a new agent token (last line)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the agent's name, a slug such as deploy-bot")
        parser.add_argument("--owner", help="username of the person accountable for it")
        parser.add_argument("--description", default="")
        parser.add_argument(
            "--new-token",
            action="store_true",
            help="if the agent exists, issue another token instead of failing",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        if slugify(name) != name:
            raise CommandError("NAME must be a slug: lowercase letters, digits and hyphens.")
        owner = None
        if options.get("owner"):
            owner = get_user_model().objects.filter(username=options["owner"]).first()
            if owner is None:
                raise CommandError(f"No user named {options['owner']!r}.")
        actor = Actor.system("manage.py agent_create")
        existing = Agent.objects.filter(name=name).first()
        if existing is not None:
            if not options["new_token"]:
                raise CommandError(f"Agent {name!r} exists; pass --new-token for another token.")
            _, secret = agent_token_create(agent=existing, actor=actor, label="cli")
            self.stdout.write(f"New token for agent {name}:")
        else:
            agent, secret = agent_create(
                name=name, actor=actor, owner=owner, description=options["description"]
            )
            self.stdout.write(f"Agent {agent.name} created ({agent.pk}). Its token:")
        self.stdout.write(secret)
