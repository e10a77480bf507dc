"""Claims on approvals and conflicts in the console: take, take over, release, and the
claim line a conflict page refreshes. The rules are approvals/services/claims.py's."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST

from approvals.models import ClaimSubject
from approvals.selectors import approval_get_for_person
from approvals.services.claims import (
    active_claims,
    claim_fingerprint,
    claim_release,
    claim_take,
)
from console.pages import console_page, error_status, is_htmx, raise_if_denied
from engine.core.errors import DomainError
from ownership.models import ConflictStatus
from ownership.selectors import conflict_get_for_person, conflict_list_for_person

CLAIM_BOX = "approvals/partials/_claim.html"


def _subject_or_404(subject: str) -> str:
    if subject not in ClaimSubject.values:
        raise Http404("Claims are on approvals and conflicts.")
    return subject


def _back(request: HttpRequest, subject: str, item_id: uuid.UUID) -> str:
    """Where a plain form returns: the page it was posted from (a local path only)."""
    back = request.POST.get("next", "")
    if back.startswith("/") and url_has_allowed_host_and_scheme(back, allowed_hosts=None):
        return back
    if subject == ClaimSubject.CONFLICT:
        return reverse("conflict_detail", args=[item_id])
    return reverse("approvals")


def claim_box_context(
    *, subject: str, item_id: uuid.UUID, claim: Any, back: str, live: bool = False
) -> dict[str, Any]:
    """What the claim line needs (the inbox's cards and the conflict page include it)."""
    return {
        "claim_subject": subject,
        "claim_item_id": item_id,
        "claim": claim,
        "claim_fp": claim_fingerprint(claim),
        "claim_back": back,
        "claim_live": live,
    }


def _box(
    request: HttpRequest,
    subject: str,
    item_id: uuid.UUID,
    *,
    error: str = "",
    status: int = 200,
    live: bool = False,
) -> HttpResponse:
    claim = active_claims(subject, [item_id]).get(item_id)
    back = request.POST.get("next", "") or request.GET.get("next", "")
    context = claim_box_context(subject=subject, item_id=item_id, claim=claim, back=back, live=live)
    context["claim_error"] = error
    return render(request, CLAIM_BOX, context, status=status)


def _respond(
    request: HttpRequest, subject: str, item_id: uuid.UUID, *, notice: str, error: str, status: int
) -> HttpResponse:
    if is_htmx(request):
        live = request.POST.get("live") == "1"
        return _box(request, subject, item_id, error=error, status=status, live=live)
    if error:
        messages.error(request, error)
    else:
        messages.success(request, notice)
    return HttpResponseRedirect(_back(request, subject, item_id))


@console_page
@require_POST
def claim_take_view(request: HttpRequest, subject: str, item_id: uuid.UUID) -> HttpResponse:
    """Claim (or renew); with `take_over_from` naming the holder the person saw, take
    someone else's claim over. A claim held by another is never replaced otherwise."""
    subject = _subject_or_404(subject)
    take_over_from = request.POST.get("take_over_from", "")[:150]
    try:
        claim_take(
            subject=subject, subject_id=item_id, person=request.user, take_over_from=take_over_from
        )
    except DomainError as exc:
        raise_if_denied(exc)
        return _respond(
            request, subject, item_id, notice="", error=exc.message, status=error_status(exc)
        )
    notice = f"You took this over from {take_over_from}." if take_over_from else "You are on it."
    return _respond(request, subject, item_id, notice=notice, error="", status=200)


@console_page
@require_POST
def claim_release_view(request: HttpRequest, subject: str, item_id: uuid.UUID) -> HttpResponse:
    subject = _subject_or_404(subject)
    try:
        claim_release(subject=subject, subject_id=item_id, person=request.user)
    except DomainError as exc:
        raise_if_denied(exc)
        return _respond(
            request, subject, item_id, notice="", error=exc.message, status=error_status(exc)
        )
    return _respond(request, subject, item_id, notice="Claim released.", error="", status=200)


@console_page
@require_GET
def claim_box_view(request: HttpRequest, subject: str, item_id: uuid.UUID) -> HttpResponse:
    """The claim line, for a page that refreshes it (the conflict page): 204 when it
    still shows `fp` (nothing to swap, the focus stays where it is)."""
    subject = _subject_or_404(subject)
    # Only someone who may see the item reads who is on it.
    _visible_or_404(request.user, subject, item_id)
    claim = active_claims(subject, [item_id]).get(item_id)
    if request.GET.get("fp") == claim_fingerprint(claim):
        return HttpResponse(status=204)
    return _box(request, subject, item_id, live=True)


def _visible_or_404(person: Any, subject: str, item_id: uuid.UUID) -> None:
    try:
        if subject == ClaimSubject.APPROVAL:
            approval_get_for_person(person, item_id)
        else:
            conflict_get_for_person(person, item_id)
    except DomainError as exc:
        raise Http404(exc.message) from exc


# --- the conflicts list's "On it" column (issue 43) -------------------------------------

CONFLICT_CLAIM_CELL = "ownership/partials/_conflict_claim.html"
# At most this many conflicts' claims are checked by one poll (a list page shows 50).
POLL_SHOWN = 200


def _claims_poll_query(fingerprints: dict[uuid.UUID, str]) -> str:
    """The list's claim poller query: each open conflict shown, with what its cell shows."""
    if not fingerprints:
        return ""
    shown = ",".join(f"{pk}~{fp}" for pk, fp in fingerprints.items())
    return urlencode({"shown": shown})


def conflict_claim_rows(conflicts: list[Any]) -> dict[str, Any]:
    """For a conflicts list page: each conflict with who is on it (open ones only; one
    query) as `conflict_rows`, and the query of the poller that keeps the column live."""
    open_ids = [c.pk for c in conflicts if c.status == ConflictStatus.OPEN]
    claims = active_claims(ClaimSubject.CONFLICT, open_ids)
    fingerprints = {pk: claim_fingerprint(claims.get(pk)) for pk in open_ids}
    return {
        "conflict_rows": [(c, claims.get(c.pk), fingerprints.get(c.pk, "")) for c in conflicts],
        "claims_poll": _claims_poll_query(fingerprints),
    }


def _shown_conflicts(value: str) -> dict[uuid.UUID, str]:
    """`shown` as conflict id -> fingerprint (malformed entries ignored, at most POLL_SHOWN)."""
    shown: dict[uuid.UUID, str] = {}
    for entry in value.split(",")[:POLL_SHOWN]:
        raw_id, _, fingerprint = entry.partition("~")
        try:
            shown[uuid.UUID(raw_id)] = fingerprint[:64]
        except ValueError:
            continue
    return shown


@console_page
@require_GET
def conflict_claims_poll(request: HttpRequest) -> HttpResponse:
    """The conflicts list's live "On it" column: the cells whose claim changed since the
    page showed them (out of band) and a fresh poller; 204 when none did. Only conflicts
    the person may see are answered (the others are silently left out)."""
    shown = _shown_conflicts(request.GET.get("shown", ""))
    visible = set(
        conflict_list_for_person(request.user)
        .filter(pk__in=list(shown), status=ConflictStatus.OPEN)
        .values_list("pk", flat=True)
    )
    claims = active_claims(ClaimSubject.CONFLICT, visible)
    now = {pk: claim_fingerprint(claims.get(pk)) for pk in shown if pk in visible}
    changed = [pk for pk, fp in now.items() if fp != shown[pk]]
    if not changed:
        return HttpResponse(status=204)
    cells = [{"id": pk, "claim": claims.get(pk), "fp": now[pk]} for pk in changed]
    context = {"cells": cells, "claims_poll": _claims_poll_query(now)}
    return render(request, "ownership/partials/_conflict_claims_poll.html", context)
