"""RQ job: the periodic whole walk of the audit chain (scheduled in approvals/cron.py)."""

from __future__ import annotations

import logging
from typing import Any

from audit.services import audit_chain_verify

logger = logging.getLogger(__name__)


def audit_verify_job() -> dict[str, Any]:
    """Walk the whole chain; the answer becomes every process's badge and API result."""
    status = audit_chain_verify()
    if not status.ok:
        logger.error(
            "audit chain broken: first bad seq %s (%s)", status.first_bad_seq, status.problem
        )
    return {"ok": status.ok, "events": status.events, "first_bad_seq": status.first_bad_seq}
