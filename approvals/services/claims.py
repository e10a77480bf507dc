"""Claims on approvals and conflicts ("Ana is on it"): take, take over, release.

A claim never decides anything and the decision services never read it; it is what the
others see so two people do not silently work the same item. The rules:
- only someone who may decide the item (a pending approval they may decide, an open
  conflict their group resolves) may claim it;
- one claim per item (the unique constraint settles two people claiming at once: one
  wins, the other is told who did);
- a claim held by someone else is never replaced silently: taking it over names the
  holder the person saw, and fails if that is no longer who holds it;
- it ends when its holder releases it, when anyone decides the item, or
  AIRLOCK_CLAIM_TTL_SECONDS after it was taken (claiming again renews it).
Every change is audited (`claim.taken`, `claim.taken_over`, `claim.released`), as the
last step of its transaction. An expired claim is recorded as released (reason
`timeout`) when the next person takes the item; nothing sweeps it earlier: it is simply
not shown once past its time.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from approvals.models import Approval, ApprovalStatus, Claim, ClaimSubject
from approvals.selectors import approval_get_for_person
from approvals.services.separation import approvals_forbidding_self
from audit.services import Actor, audit_append
from console.permissions import can_decide_approvals
from engine.core.errors import DomainError, Forbidden, NotFound, ValidationFailed
from ownership.models import Conflict, ConflictStatus
from ownership.selectors import conflict_get_for_person, conflict_may_resolve

# The product's clock for claims (tests move it instead of sleeping).
clock: Callable[[], datetime] = timezone.now


class ClaimHeld(DomainError):
    """Someone else holds the claim (409): take it over deliberately, naming them."""

    code = "claim_held"


def _claim_ttl() -> timedelta:
    return timedelta(seconds=settings.AIRLOCK_CLAIM_TTL_SECONDS)


@dataclass(frozen=True)
class _Item:
    """What the audit event says about the claimed item."""

    resource: str
    run_id: uuid.UUID | None
    action_id: uuid.UUID | None


def _subject(value: str) -> str:
    if value not in ClaimSubject.values:
        raise ValidationFailed("Claims are on an approval or a conflict.", code="validation_error")
    return value


def _workable_item(subject: str, subject_id: uuid.UUID, person: Any) -> _Item:
    """The item, if `person` may decide it now (404 if they cannot see it, 403/409 if
    they see it but may not work it)."""
    if subject == ClaimSubject.APPROVAL:
        approval = approval_get_for_person(person, subject_id)
        if approval.status != ApprovalStatus.PENDING:
            raise DomainError("This approval is already decided.", code="already_decided")
        if not can_decide_approvals(person) and approval.escalated_at is None:
            raise Forbidden("Only people who may decide an approval claim it.")
        if approvals_forbidding_self(approvals=[approval], actor=Actor.person(person)):
            raise Forbidden("You may not decide this approval (separation of duties).")
        action = approval.action
        return _Item(
            resource=action.resource_identifier if action is not None else "",
            run_id=approval.run_id,
            action_id=approval.action_id,
        )
    conflict = conflict_get_for_person(person, subject_id)
    if conflict.status != ConflictStatus.OPEN:
        raise DomainError("This conflict is already resolved.", code="already_decided")
    if not conflict_may_resolve(conflict=conflict, person=person):
        raise Forbidden("Only the resolver group of this conflict claims it.")
    return _Item(
        resource=conflict.resource.identifier,
        run_id=None,
        action_id=conflict.action_id,
    )


def _audit(
    event_type: str, *, actor: Any, subject: str, subject_id: uuid.UUID, item: _Item, **details: Any
) -> None:
    audit_append(
        event_type=event_type,
        actor=Actor.person(actor),
        resource=item.resource,
        run_id=item.run_id,
        action_id=item.action_id,
        details={"subject": subject, "subject_id": str(subject_id), **details},
    )


def claim_take(
    *, subject: str, subject_id: uuid.UUID, person: Any, take_over_from: str = ""
) -> Claim:
    """Claim the item for `person` for the claim TTL (renewing their own claim).

    Someone else's live claim is replaced only when `take_over_from` names its holder
    (their username, as the person saw it); otherwise ClaimHeld says who holds it."""
    subject = _subject(subject)
    item = _workable_item(subject, subject_id, person)
    now = clock()
    expires = now + _claim_ttl()
    with transaction.atomic():
        held = (
            Claim.objects.select_for_update()
            .select_related("holder")
            .filter(subject=subject, subject_id=subject_id)
            .first()
        )
        if held is None:
            try:
                with transaction.atomic():
                    claim = Claim.objects.create(
                        subject=subject,
                        subject_id=subject_id,
                        holder=person,
                        taken_at=now,
                        expires_at=expires,
                    )
            except IntegrityError:
                # Another person's insert won the race since our read: say who.
                winner = (
                    Claim.objects.select_related("holder")
                    .filter(subject=subject, subject_id=subject_id)
                    .first()
                )
                name = winner.holder.get_username() if winner else "someone"
                raise ClaimHeld(f"{name} has just claimed this.", extra={"holder": name}) from None
            _audit("claim.taken", actor=person, subject=subject, subject_id=subject_id, item=item)
            return claim
        holder_name = held.holder.get_username()
        if held.holder_id == person.pk:
            # Renewal: the same person still on it; no event (the claim did not change hands).
            held.expires_at = expires
            held.save(update_fields=["expires_at"])
            return held
        if held.expires_at <= now:
            _audit(
                "claim.released",
                actor=held.holder,
                subject=subject,
                subject_id=subject_id,
                item=item,
                reason="timeout",
                holder=holder_name,
            )
            event, details = "claim.taken", {}
        elif take_over_from != holder_name:
            raise ClaimHeld(
                f"{holder_name} is on it (claimed until {held.expires_at:%H:%M} UTC). "
                "Take it over deliberately if you must.",
                extra={"holder": holder_name},
            )
        else:
            event, details = "claim.taken_over", {"previous_holder": holder_name}
        held.holder, held.taken_at, held.expires_at = person, now, expires
        held.save(update_fields=["holder", "taken_at", "expires_at"])
        _audit(event, actor=person, subject=subject, subject_id=subject_id, item=item, **details)
        return held


def claim_release(*, subject: str, subject_id: uuid.UUID, person: Any) -> bool:
    """The holder lets go of their claim. False when they hold none (nothing to do);
    ClaimHeld when someone else holds it (one releases only one's own)."""
    subject = _subject(subject)
    with transaction.atomic():
        held = (
            Claim.objects.select_for_update()
            .select_related("holder")
            .filter(subject=subject, subject_id=subject_id)
            .first()
        )
        if held is None or held.expires_at <= clock():
            return False
        if held.holder_id != person.pk:
            name = held.holder.get_username()
            raise ClaimHeld(f"{name} holds this claim, not you.", extra={"holder": name})
        item = _item_for_audit(subject, subject_id)
        held.delete()
        _audit(
            "claim.released",
            actor=person,
            subject=subject,
            subject_id=subject_id,
            item=item,
            reason="released",
        )
        return True


def claim_end_on_decision(*, subject: str, subject_id: uuid.UUID, person: Any) -> None:
    """The item was decided by `person`: whoever held it, the claim is over (audited
    `claim.released`, reason `decided`). Nothing happens when there was no claim."""
    with transaction.atomic():
        held = (
            Claim.objects.select_for_update()
            .select_related("holder")
            .filter(subject=subject, subject_id=subject_id)
            .first()
        )
        if held is None:
            return
        expired = held.expires_at <= clock()
        holder_name = held.holder.get_username()
        item = _item_for_audit(subject, subject_id)
        held.delete()
        _audit(
            "claim.released",
            actor=person,
            subject=subject,
            subject_id=subject_id,
            item=item,
            reason="timeout" if expired else "decided",
            holder=holder_name,
        )


def _item_for_audit(subject: str, subject_id: uuid.UUID) -> _Item:
    """The item's resource and ids whatever its state (the release of a decided item)."""
    if subject == ClaimSubject.APPROVAL:
        approval = Approval.objects.select_related("action").filter(pk=subject_id).first()
        if approval is None:
            raise NotFound("No such approval.")
        action = approval.action
        return _Item(
            resource=action.resource_identifier if action is not None else "",
            run_id=approval.run_id,
            action_id=approval.action_id,
        )
    conflict = Conflict.objects.select_related("resource").filter(pk=subject_id).first()
    if conflict is None:
        raise NotFound("No such conflict.")
    return _Item(resource=conflict.resource.identifier, run_id=None, action_id=conflict.action_id)


def active_claims(subject: str, subject_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, Claim]:
    """The live claims on these items, by item id (one query; expired ones left out)."""
    ids = list(subject_ids)
    if not ids:
        return {}
    rows = Claim.objects.select_related("holder").filter(
        subject=subject, subject_id__in=ids, expires_at__gt=clock()
    )
    return {claim.subject_id: claim for claim in rows}


def claim_fingerprint(claim: Claim | None) -> str:
    """What the page shows of a claim, as a short string the live refresh compares
    (a card is re-sent only when this changed)."""
    if claim is None:
        return "-"
    return f"{claim.holder_id}.{int(claim.taken_at.timestamp())}"
