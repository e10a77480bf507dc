"""Claims on approvals and conflicts in the console: take, take over, release, and the
claim line a conflict page refreshes. The rules are approvals/services/claims.py's."""

from __future__ import annotations

import uuid
from typing import Any

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
from console.core.errors import DomainError
from console.pages import console_page, error_status, is_htmx, raise_if_denied
from ownership.selectors import conflict_get_for_person

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
