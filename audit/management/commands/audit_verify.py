"""`python manage.py audit_verify`: walk the whole chain; exit 1 naming the first bad seq, or
the first anchor (`--anchor FILE`, written by `audit_anchor --append`) the chain lost."""

from __future__ import annotations

import json
import re
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit.models import AuditEvent
from audit.services import audit_chain_verify
from audit.verify import Anchor, anchor_missing, audit_head

_HASH = re.compile(r"^[0-9a-f]{64}$")


class Command(BaseCommand):
    help = (
        "Verify the whole hash-chained audit trail and record the result for the console and "
        "the API. Always prints the event count and the head hash (anchor it outside the "
        "database: manage.py audit_anchor); exits 1 naming the first bad seq, or the first "
        "anchor the chain no longer holds."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--chunk-size", type=int, default=2000)
        parser.add_argument(
            "--anchor",
            action="append",
            default=[],
            metavar="FILE|HASH",
            help="a file of anchored heads ({seq, hash, time} a line, as audit_anchor "
            "--append writes them), or one head hash printed earlier: fail unless the "
            "verified chain still holds each one (may be given more than once)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        given = options["anchor"]
        anchors = _read_anchors([given] if isinstance(given, str) else given)
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
        self._check_anchors(anchors)
        self.stdout.write(self.style.SUCCESS("audit chain ok"))

    def _check_anchors(self, anchors: list[Anchor | str]) -> None:
        for digest in (a for a in anchors if isinstance(a, str)):
            if not AuditEvent.objects.filter(hash=digest).exists():
                raise CommandError(
                    f"the anchored hash {digest} is no longer in the chain (rewritten history)",
                    returncode=1,
                )
        heads = [anchor for anchor in anchors if isinstance(anchor, Anchor)]
        missing = anchor_missing(heads)
        if missing is not None:
            anchor, why = missing
            raise CommandError(
                f"anchor #{anchor.seq} {anchor.hash} of {anchor.time or '?'} ({anchor.where}) "
                f"is no longer in the chain (rewritten history): {why}",
                returncode=1,
            )
        if heads:
            self.stdout.write(f"anchors: every one of {len(heads)} is in the chain")


def _read_anchors(given: list[str]) -> list[Anchor | str]:
    """Each --anchor: a bare head hash (kept as it is), or a file of anchors."""
    anchors: list[Anchor | str] = []
    for value in given:
        if _HASH.match(value):
            anchors.append(value)
            continue
        try:
            with open(value, encoding="utf-8") as lines:
                for number, line in enumerate(lines, start=1):
                    if line.strip():
                        anchors.append(_anchor(line, f"{value} line {number}"))
        except OSError as exc:
            raise CommandError(f"cannot read the anchor file: {exc}", returncode=2) from exc
    return anchors


def _anchor(line: str, where: str) -> Anchor:
    try:
        data = json.loads(line)
        seq, digest = data["seq"], data["hash"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CommandError(f"{where}: not an anchor {{seq, hash, time}}", returncode=2) from exc
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(digest, str):
        raise CommandError(f"{where}: not an anchor {{seq, hash, time}}", returncode=2)
    return Anchor(seq=seq, hash=digest, time=str(data.get("time", "")), where=where)
