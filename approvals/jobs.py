"""RQ jobs: thin, take ids, call services. Owner: engine helper.

Interface contract used by other areas:

enqueue_action_execution(action_id: uuid.UUID) -> None
    Call inside transaction.on_commit(...) only. Enqueues the job that executes
    an approved/queued action. Safe to call twice (the job is idempotent).
"""

from __future__ import annotations

import uuid


def enqueue_action_execution(action_id: uuid.UUID) -> None:
    raise NotImplementedError  # owner: engine helper
