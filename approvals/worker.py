"""The Procfile's worker class: RQ's SimpleWorker with the engine's jobs loaded up front.

RQ imports a job's function by its dotted path when it runs the job, so the first job a
worker takes after a start or restart also paid for importing the whole engine (the
services, the HTTP target client): 0.2-0.26 s on this machine, a fifth of the bench's drain
window, and that much later for the first approved write after every deploy. Importing
this module (rqworker's `--worker-class` does, before the worker takes a job) loads them,
as a web server preloads its application.
"""

from __future__ import annotations

from rq.worker import SimpleWorker

import approvals.jobs  # noqa: F401  # the job functions the outbox enqueues by dotted path


class EngineWorker(SimpleWorker):
    """SimpleWorker (the job runs in the worker process: see README "Worker class"); only
    its module's import differs, above."""
