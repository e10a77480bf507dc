"""What the commands that register a principal share (agent_create, person_create)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandParser

from audit.services import Actor


class PrincipalCommand(BaseCommand):
    """Register a principal and print a new token for it as the last line (scripts
    take it with `tail -n 1`). With --new-token, a principal that exists already gets
    another token instead of the refusal; the audit names the command as the actor."""

    principal: ClassVar[str]  # "agent"
    token: ClassVar[str]  # "token"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--new-token",
            action="store_true",
            help=f"if the {self.principal} exists, issue another {self.token} instead of failing",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        actor = Actor.system(f"manage.py {type(self).__module__.rsplit('.', 1)[-1]}")
        name, existing = self.existing(options)
        if existing is not None and options["new_token"]:
            heading = f"New {self.token} for {self.principal} {name}:"
            secret = self.another_token(existing, actor)
        else:
            heading, secret = self.create(options, actor, exists=existing is not None)
        self.stdout.write(heading)
        self.stdout.write(secret)

    def existing(self, options: dict[str, Any]) -> tuple[str, Any]:
        """The name asked for and the principal of that name, if there is one."""
        raise NotImplementedError

    def another_token(self, existing: Any, actor: Actor) -> str:
        raise NotImplementedError

    def create(self, options: dict[str, Any], actor: Actor, *, exists: bool) -> tuple[str, str]:
        """Register the principal; the heading to print and its token's secret.
        Raises CommandError with what the service refused."""
        raise NotImplementedError
