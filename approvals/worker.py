"""The Procfile's worker class: RQ's SimpleWorker with the engine's jobs loaded up front,
publishing its presence while it lives.

RQ imports a job's function by its dotted path when it runs the job, so the first job a
worker takes after a start or restart also paid for importing the whole engine (the
services, the HTTP target client): 0.2-0.26 s on this machine, a fifth of the bench's drain
window, and that much later for the first approved write after every deploy. Importing
this module (rqworker's `--worker-class` does, before the worker takes a job) loads them,
as a web server preloads its application.

Presence (approvals/services/worker_presence.py): the worker is named
`<host>:<pid>@<boot token>` (unless `--name` says otherwise) and a daemon thread
refreshes its presence key every two seconds, also while a job runs. When the process
dies (SIGKILL, OOM) the key expires within seconds, and the reconciler resumes the work
it held without waiting for leases, locks or RQ's own abandoned-job cleanup (which, for
a SimpleWorker, comes only after the job's timeout plus a minute). See docs/recovery.md.
"""

from __future__ import annotations

from typing import Any

from rq.worker import SimpleWorker

import approvals.jobs  # noqa: F401  # the job functions the outbox enqueues by dotted path
from approvals.services.worker_presence import WorkerPresence, publishing_name
from console import tracing


class EngineWorker(SimpleWorker):
    """SimpleWorker (the job runs in the worker process: see README "Worker class") that
    publishes its presence from before its first job until it stops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("name"):
            kwargs["name"] = publishing_name()
        super().__init__(*args, **kwargs)

    def work(self, *args: Any, **kwargs: Any) -> bool:
        # Traces when OTEL_EXPORTER_OTLP_ENDPOINT is set (console/tracing.py); the spans
        # still buffered are sent when the worker stops.
        tracing.setup_from_env("airlock-worker", django=False)
        presence = WorkerPresence(self.name, self.connection)
        presence.start()
        try:
            return bool(super().work(*args, **kwargs))
        finally:
            presence.stop()
            tracing.force_flush()
