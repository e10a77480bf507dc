"""The `notify` worker's reader of the audit chain: a thread that turns committed events into
notifications and deliveries (notifications/services/dispatch.py) while the worker runs.

It reads again at once while a pass found a full batch, and otherwise every
AIRLOCK_NOTIFY_DISPATCH_SECONDS (a pass with nothing to read is one small statement). Several
notify workers may each run one: the cursor's row lock lets one pass read at a time and the
others skip. A database outage is logged and retried on the next tick; the cron's tick
reads too, so events are told even with no notify worker up (once one delivers them).
"""

from __future__ import annotations

import logging
import threading

from django.db import close_old_connections

from notifications.services.dispatch import notifications_dispatch

log = logging.getLogger("airlock.notifications")
_BATCH = 500


class ChainReader:
    """A daemon thread calling notifications_dispatch until `stop`."""

    def __init__(self, every_seconds: float) -> None:
        self.every_seconds = every_seconds
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notify-chain", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            read = self._pass()
            if read < _BATCH:
                self._stopping.wait(self.every_seconds)

    def _pass(self) -> int:
        close_old_connections()
        try:
            return notifications_dispatch(limit=_BATCH).read
        except Exception:  # the database went away: the next tick tries again
            log.exception("notifications: reading the audit chain failed")
            return 0
        finally:
            close_old_connections()

    def stop(self) -> None:
        """Let the pass in flight finish (it commits or rolls back whole), then end."""
        self._stopping.set()
        self._thread.join(timeout=30)


_reader: ChainReader | None = None


def chain_reader_start(every_seconds: float) -> ChainReader:
    """Start reading the chain in this process (NotifyWorker, at its start)."""
    global _reader
    _reader = ChainReader(every_seconds)
    _reader.start()
    return _reader


def chain_reader_stop() -> None:
    global _reader
    reader, _reader = _reader, None
    if reader is not None:
        reader.stop()
