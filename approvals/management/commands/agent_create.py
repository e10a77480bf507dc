"""`manage.py agent_create NAME [--owner USERNAME] [--description D] [--new-token]`:
register an agent through the token service (audited, validated as on the Tokens
page), and print its token (ak_…) as the last line."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from approvals.models import Agent
from approvals.services.tokens import agent_create, agent_token_create
from audit.services import Actor
from console.management import PrincipalCommand
from engine.core.errors import ValidationFailed


class Command(PrincipalCommand):
    help = "Register an agent and print a new agent token (last line)."
    principal = "agent"
    token = "token"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the agent's name, a slug such as deploy-bot")
        parser.add_argument("--owner", default="", help="username of the person accountable")
        parser.add_argument("--description", default="")
        super().add_arguments(parser)

    def existing(self, options: dict[str, Any]) -> tuple[str, Any]:
        name = options["name"]
        return name, Agent.objects.filter(name=name).first()

    def another_token(self, existing: Any, actor: Actor) -> str:
        return agent_token_create(agent=existing, actor=actor, label="cli")[1]

    def create(self, options: dict[str, Any], actor: Actor, *, exists: bool) -> tuple[str, str]:
        try:
            agent, secret = agent_create(
                name=options["name"],
                actor=actor,
                owner=options["owner"],
                description=options["description"],
            )
        except ValidationFailed as exc:
            hint = " (pass --new-token for another token)" if exists else ""
            raise CommandError(f"{exc.message}{hint}") from exc
        return f"Agent {agent.name} created ({agent.pk}). Its token:", secret
