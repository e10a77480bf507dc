"""`python manage.py audit_export --jsonl`: the whole chain as JSON Lines, oldest first —
the console export's lines (the API's representation), for `airlock-audit verify --file`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from audit.linker import audit_link
from audit.selectors import audit_queryset
from audit.serialize import event_jsonl
from audit.verify import audit_head


class Command(BaseCommand):
    help = (
        "Write every audit event up to the current head as JSON Lines (one API event a line, "
        "oldest first), to standard output or --output FILE."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--jsonl", action="store_true", help="JSON Lines (the default and only format)"
        )
        parser.add_argument("--output", metavar="FILE", help="write here, not to stdout")
        parser.add_argument(
            "--after-seq", type=int, default=0, help="only the events after this seq"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # What has committed is linked first; the export ends at the head: every event up to
        # it is linked and none below it can appear later.
        audit_link(wait_seconds=1.0)
        head_seq, head_hash = audit_head()
        path = options["output"]
        try:
            if path:
                with open(path, "w", encoding="utf-8") as out:
                    count = _write(out.write, after=options["after_seq"], upto=head_seq)
            else:
                count = _write(self.stdout.write, after=options["after_seq"], upto=head_seq)
        except OSError as exc:
            raise CommandError(f"cannot write the export: {exc}", returncode=1) from exc
        self.stderr.write(f"exported {count} events, head #{head_seq} {head_hash}")


def _write(write: Callable[[str], Any], *, after: int, upto: int) -> int:
    events = audit_queryset().filter(seq__gt=after, seq__lte=upto).order_by("seq")
    count = 0
    # Inside a transaction the server-side cursor streams (no full load in memory).
    with transaction.atomic():
        for event in events.iterator(chunk_size=2000):
            write(event_jsonl(event))
            count += 1
    return count
