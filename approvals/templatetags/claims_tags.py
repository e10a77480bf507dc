"""`{% claim_box "conflict" conflict.id %}`: who is on an item, live (a page other than
the inbox, which refreshes its cards' claims in its own poll)."""

from __future__ import annotations

from typing import Any

from django import template

from approvals.services.claims import active_claims
from approvals.views.claims import claim_box_context

register = template.Library()


@register.inclusion_tag("approvals/partials/_claim.html", takes_context=True)
def claim_box(context: Any, subject: str, item_id: Any) -> dict[str, Any]:
    request = context["request"]
    claim = active_claims(subject, [item_id]).get(item_id)
    box = claim_box_context(
        subject=subject, item_id=item_id, claim=claim, back=request.path, live=True
    )
    return {**box, "user": request.user, "csrf_token": context.get("csrf_token")}
