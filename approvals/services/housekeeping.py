"""Housekeeping: the periodic sweeps that keep PostgreSQL state honest.

Scheduled with RQ's cron scheduler (`python manage.py rqcron approvals.cron`,
see approvals/cron.py): reconcile every 5 s, housekeeping every 30 s. Every
sweep is idempotent and safe to run from several processes at once.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from approvals.models import Operation, OperationStatus
from approvals.services.decisions import approval_expire_due
from approvals.services.idempotency import idempotency_prune
from approvals.services.runs import run_expire_due
from audit.services import Actor
from engine.core.action_audit import audit_action_event
from ownership.models import OwnershipRecord

log = logging.getLogger("airlock.housekeeping")


def _lease_expire_due(*, now: datetime | None = None) -> int:
    """Exclusive leases (and plain ownership records) past expires_at stop being active."""
    now = now or timezone.now()
    return OwnershipRecord.objects.filter(active=True, expires_at__lte=now).update(
        active=False, released_at=now
    )


def _undo_windows_finalise(*, now: datetime | None = None) -> int:
    """Mark done operations whose undo window closed (outcome.undo_window_closed)
    and audit it once per operation, so the trail says when undo stopped being possible."""
    now = now or timezone.now()
    count = 0
    not_closed = Q(outcome__isnull=True) | ~Q(outcome__has_key="undo_window_closed")
    due = Operation.objects.filter(
        not_closed, status=OperationStatus.DONE, undo_of__isnull=True, undo_deadline__lte=now
    )
    for operation in due.select_related("action__kind")[:1000]:
        with transaction.atomic():
            outcome = dict(operation.outcome or {})
            outcome["undo_window_closed"] = True
            updated = Operation.objects.filter(
                not_closed, pk=operation.pk, status=OperationStatus.DONE
            ).update(outcome=outcome)
            if not updated:
                continue
            audit_action_event(
                operation.action,
                event_type="undo.window_closed",
                actor=Actor.system("housekeeping"),
                details={"operation": operation.pk, "undo_deadline": operation.undo_deadline},
            )
            count += 1
    return count


def housekeeping_run(*, now: datetime | None = None) -> dict[str, int]:
    """One sweep: runs, approvals, leases, idempotency records, undo windows."""
    now = now or timezone.now()
    counts: dict[str, int] = {}
    counts["runs_expired"] = int(run_expire_due(now=now) or 0)
    approvals = approval_expire_due(now=now)
    counts["approvals_expired"] = approvals["expired"]
    counts["approvals_escalated"] = approvals["escalated"]
    counts["leases_expired"] = _lease_expire_due(now=now)
    counts["idempotency_pruned"] = int(idempotency_prune(now=now) or 0)
    counts["undo_windows_closed"] = _undo_windows_finalise(now=now)
    if any(counts.values()):
        log.info("housekeeping: %s", counts)
    return counts
