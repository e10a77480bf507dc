"""`manage.py agent_create NAME [--owner USERNAME] [--description D] [--new-token]`:
register an agent through the token service (audited, validated as on the Tokens
page), and print its token (ak_…) as the last line."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from approvals.models import Agent
from approvals.services.tokens import agent_create, agent_token_create
from audit.services import Actor
from console.core.errors import ValidationFailed


class Command(BaseCommand):
    help = "Register an agent and print a new agent token (last line)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the agent's name, a slug such as deploy-bot")
        parser.add_argument("--owner", default="", help="username of the person accountable")
        parser.add_argument("--description", default="")
        parser.add_argument(
            "--new-token",
            action="store_true",
            help="if the agent exists, issue another token instead of failing",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name = options["name"]
        actor = Actor.system("manage.py agent_create")
        existing = Agent.objects.filter(name=name).first()
        if existing is not None and options["new_token"]:
            _, secret = agent_token_create(agent=existing, actor=actor, label="cli")
            self.stdout.write(f"New token for agent {name}:")
            self.stdout.write(secret)
            return
        try:
            agent, secret = agent_create(
                name=name,
                actor=actor,
                owner=options["owner"],
                description=options["description"],
            )
        except ValidationFailed as exc:
            hint = " (pass --new-token for another token)" if existing is not None else ""
            raise CommandError(f"{exc.message}{hint}") from exc
        self.stdout.write(f"Agent {agent.name} created ({agent.pk}). Its token:")
        self.stdout.write(secret)
