"""The chain walk over the stored events: the head row, and a walk from a verified point.

Below audit.services (which keeps the shared checkpoint): the floor of the domain, so the
append and the verification import nothing above them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from django.db import transaction

from audit.chain import GENESIS_HASH, HASHED_COLUMNS, VerifyResult, against_head, verify_rows
from audit.models import AuditEvent, AuditHead

# Only what the walk needs: named tuples, not model instances (about twice as fast).
_CHAIN_FIELDS = (*HASHED_COLUMNS, "prev_hash", "hash")


def audit_head() -> tuple[int, str]:
    head = AuditHead.objects.filter(pk=1).values_list("seq", "hash").first()
    return (int(head[0]), str(head[1])) if head else (0, GENESIS_HASH)


def verify_chain(*, after: tuple[int, str] | None = None, chunk_size: int = 2000) -> VerifyResult:
    """Walk the chain in seq order (streamed) and compare its end with the head row.

    The whole chain by default; with `after=(seq, hash)`, a point already verified,
    only the events after it (the walk then starts from that hash). The walk stops
    at the head read before it, so appends made meanwhile are the next walk's tail.

    Only linked events (up to the head) are walked; the ones the linker has not reached
    yet are audit_unlinked's. Detects an edited row (hash mismatch), a deleted or
    inserted row (broken link), reordered rows (broken link) and a truncated tail (the
    head row says the chain is longer); a whole walk also finds a linked row past the
    head (linked behind the linker's back). The head hash printed by `audit_verify` is
    what to anchor outside the database: a forger who rewrites the tail *and* the head
    row is caught only by comparing with an anchored hash.
    """
    head_seq, head_hash = audit_head()
    after_seq, after_hash = after or (0, GENESIS_HASH)
    rows = AuditEvent.objects.filter(seq__lte=head_seq).order_by("seq")
    if after is not None:
        rows = rows.filter(seq__gt=after_seq)
    # Inside a transaction the server-side cursor streams instead of being
    # materialised WITH HOLD first, as it is in autocommit.
    with transaction.atomic():
        walked = verify_rows(
            rows.values_list(*_CHAIN_FIELDS, named=True).iterator(chunk_size=chunk_size),
            after_seq=after_seq,
            after_hash=after_hash,
        )
    result = against_head(walked, head_seq=head_seq, head_hash=head_hash)
    if after is None and result.ok:
        result = _nothing_beyond_the_head(result)
    return result


def _nothing_beyond_the_head(result: VerifyResult) -> VerifyResult:
    # Past the head stand only events the linker has not reached: a linked one there was not
    # linked by the linker (which moves the head with its last link, in one transaction).
    head_seq, _ = audit_head()
    forged = (
        AuditEvent.objects.filter(seq__gt=head_seq)
        .exclude(hash="")
        .order_by("seq")
        .values_list("seq", flat=True)
        .first()
    )
    if forged is None:
        return result
    return replace(
        result,
        ok=False,
        first_bad_seq=int(forged),
        problem=f"event #{forged} stands linked beyond the head row (#{head_seq})",
    )


@dataclass(frozen=True)
class Anchor:
    """A head kept outside the database (`manage.py audit_anchor`): `where` names it."""

    seq: int
    hash: str
    time: str = ""
    where: str = ""


def anchor_missing(anchors: Sequence[Anchor]) -> tuple[Anchor, str] | None:
    """The first anchor (in the order given) the chain no longer holds, and why: no event
    at its seq, or one with another hash. A history rewritten together with the head row
    walks whole; only an anchor kept elsewhere shows it."""
    stored: dict[int, str] = {}
    seqs = sorted({anchor.seq for anchor in anchors})
    for start in range(0, len(seqs), 1000):
        chunk = seqs[start : start + 1000]
        stored.update(AuditEvent.objects.filter(seq__in=chunk).values_list("seq", "hash"))
    for anchor in anchors:
        if anchor.seq == 0 and anchor.hash == GENESIS_HASH:
            continue  # anchored while the chain was empty
        found = stored.get(anchor.seq)
        if found is None:
            return anchor, f"the chain has no event #{anchor.seq} (its head is #{audit_head()[0]})"
        if found != anchor.hash:
            return anchor, f"event #{anchor.seq} now has hash {found}"
    return None
