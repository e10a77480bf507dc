"""`python manage.py audit_verify`: walk the whole chain; exit 1 naming the first bad seq."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit.models import AuditEvent
from audit.services import audit_chain_verify
from audit.verify import audit_head


class Command(BaseCommand):
    help = (
        "Verify the whole hash-chained audit trail and record the result for the console and "
        "the API. Always prints the event count and the head hash (anchor it outside the "
        "database); exits 1 naming the first bad seq."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--chunk-size", type=int, default=2000)
        parser.add_argument(
            "--anchor",
            default="",
            help="a head hash printed earlier and kept outside the database: "
            "fail unless the verified chain still contains it",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        result = audit_chain_verify(chunk_size=options["chunk_size"])
        if result.ok:
            self.stdout.write(f"events: {result.events}")
            self.stdout.write(f"head: {result.head_hash}")
        else:
            head_seq, head_hash = audit_head()
            self.stdout.write(f"events: {AuditEvent.objects.count()} (head row at #{head_seq})")
            self.stdout.write(f"head: {head_hash}")
            self.stdout.write(
                f"verified: {result.events} events, last good hash {result.head_hash}"
            )
            raise CommandError(
                f"audit chain broken: first bad seq {result.first_bad_seq} ({result.problem})",
                returncode=1,
            )
        anchor = options["anchor"]
        if anchor and not AuditEvent.objects.filter(hash=anchor).exists():
            raise CommandError(
                f"the anchored hash {anchor} is no longer in the chain (rewritten history)",
                returncode=1,
            )
        self.stdout.write(self.style.SUCCESS("audit chain ok"))
