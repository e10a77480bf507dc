"""`python manage.py reconcile [--housekeeping] [--loop SECONDS]` — run the outbox
reconciler once (or forever), optionally with housekeeping."""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from approvals.services.housekeeping import housekeeping_run
from approvals.services.reconcile import reconcile


class Command(BaseCommand):
    help = "Re-enqueue approved work whose RQ job is missing; recover abandoned operations."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--housekeeping", action="store_true", help="also run housekeeping")
        parser.add_argument(
            "--loop", type=float, default=0.0, help="repeat every N seconds until interrupted"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        while True:
            result: dict[str, Any] = {"reconcile": reconcile()}
            if options["housekeeping"]:
                result["housekeeping"] = housekeeping_run()
            self.stdout.write(json.dumps(result))
            if not options["loop"]:
                return
            time.sleep(options["loop"])
