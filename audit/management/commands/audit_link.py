"""`python manage.py audit_link`: link committed audit events into the chain (audit/linker.py).

The Procfile's `audit` process runs it with `--forever`: a pass every AIRLOCK_AUDIT_LINK_EVERY_MS
(at once again while a pass found work). Several may run; the head row's lock lets one link at a
time. A database outage is logged and retried; on SQLite (events are linked as they are
appended) the loop only idles.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.db import close_old_connections, connection

from audit.linker import audit_link

log = logging.getLogger("airlock.audit")


class Command(BaseCommand):
    help = "Link committed audit events into the hash chain (once, or --forever)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--forever", action="store_true", help="keep linking until stopped")

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["forever"]:
            done = audit_link(wait_seconds=1.0)
            self.stdout.write(f"linked {done.linked}, head #{done.head_seq} {done.held_back}")
            return
        stopping = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stopping.set())
        every = settings.AIRLOCK_AUDIT_LINK_EVERY_MS / 1000
        if connection.vendor != "postgresql":  # appends are linked as they are made there
            stopping.wait()
            return
        while not stopping.is_set():
            if _pass() == 0:
                stopping.wait(every)


def _pass() -> int:
    close_old_connections()
    try:
        # Long enough a wait that a transaction held open elsewhere in the cluster is
        # looked past by lock (audit/linker.py), short enough to keep the pass brisk.
        return audit_link(wait_seconds=0.5).linked
    except Exception:  # the database went away: the next tick tries again
        log.exception("audit: linking the chain failed")
        return 0
    finally:
        close_old_connections()
