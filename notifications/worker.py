"""The Procfile's `notify` worker class: RQ's SimpleWorker with the notifications' jobs
loaded up front (as approvals/worker.py does for the engine's), serving the
`notifications` queue only.

A SimpleWorker runs each delivery in the worker's own process (no fork a job): a delivery spends
its time waiting on a receiver, not computing, and the claim (`claimed_until`) with the
reconciler already covers a worker that dies mid-delivery.
"""

from __future__ import annotations

from rq.worker import SimpleWorker

import notifications.jobs  # noqa: F401  # the job functions the outbox enqueues by dotted path


class NotifyWorker(SimpleWorker):
    """A SimpleWorker that imported the notifications' jobs before its first job."""
