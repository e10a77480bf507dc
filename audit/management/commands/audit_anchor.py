"""`python manage.py audit_anchor`: print the verified head `{seq, hash, time}` as one JSON
line, to keep outside the database (`--append FILE`, `--post URL`); `audit_verify --anchor
FILE` later proves the chain still holds every head kept."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from audit.chain import hashed_time
from audit.services import audit_chain_status


class Command(BaseCommand):
    help = (
        "Print the audit chain's head {seq, hash, time} as JSON, after checking the events "
        "appended since the last verification; optionally append it to a file and POST it "
        "to a URL. Refuses (exit 1) to anchor a broken chain."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--append", metavar="FILE", help="append the anchor as a JSON line")
        parser.add_argument("--post", metavar="URL", help="POST the anchor as JSON to this URL")
        parser.add_argument(
            "--timeout", type=float, default=5.0, help="seconds for the POST (default 5)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # fresh: the head as it is now, its new events walked from the shared checkpoint.
        status = audit_chain_status(fresh=True)
        if not status.ok:
            raise CommandError(
                f"refusing to anchor a broken chain: first bad seq {status.first_bad_seq} "
                f"({status.problem})",
                returncode=1,
            )
        anchor = {
            "seq": status.events,
            "hash": status.head_hash,
            "time": hashed_time(timezone.now()),
        }
        line = json.dumps(anchor, separators=(",", ":"))
        self.stdout.write(line)
        if options["append"]:
            _append_line(options["append"], line)
        if options["post"]:
            _post(options["post"], anchor, timeout=options["timeout"])


def _append_line(path: str, line: str) -> None:
    try:
        with open(path, "a", encoding="utf-8") as anchors:
            anchors.write(line + "\n")
            anchors.flush()
            os.fsync(anchors.fileno())  # an anchor is only worth keeping once it is on disk
    except OSError as exc:
        raise CommandError(f"cannot append the anchor to {path}: {exc}", returncode=1) from exc


def _post(url: str, anchor: dict[str, Any], *, timeout: float) -> None:
    try:
        response = httpx.post(url, json=anchor, timeout=timeout)
    except httpx.HTTPError as exc:
        raise CommandError(f"POST {url} failed: {exc}", returncode=1) from exc
    if not response.is_success:
        raise CommandError(f"POST {url} answered {response.status_code}", returncode=1)
