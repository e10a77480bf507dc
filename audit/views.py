"""Audit trail pages: filtered list, chain-verification badge, JSON Lines export."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from audit import selectors
from audit.forms import AuditFilterForm
from audit.linker import audit_link
from audit.serialize import event_jsonl
from audit.services import audit_chain_status
from console.pages import (
    console_page,
    forbid_unless_reader,
    query_without,
    render_fragment_or_page,
)

PAGE = 50


def _filters(form: AuditFilterForm) -> dict[str, Any]:
    """The selector's filters from the page's form (an invalid form filters nothing)."""
    if not form.is_valid():
        return {}
    data = form.cleaned_data
    names = ("resource", "run", "action", "agent", "person", "since", "until")
    return {"event_type": data.get("type"), **{name: data.get(name) for name in names}}


_READERS_ONLY = "The audit trail is for operators, admins and auditors."


@console_page
@require_GET
def audit_list(request: HttpRequest) -> HttpResponse:
    forbid_unless_reader(request, _READERS_ONLY)
    event_types = selectors.audit_event_types()
    form = AuditFilterForm(request.GET or None, event_types=event_types)
    before = request.GET.get("before", "")
    page = selectors.audit_list(
        filters=_filters(form),
        cursor=f"s{before}" if before.isdigit() and len(before) <= 18 else None,
        limit=PAGE,
    )
    context = {
        "nav": "audit",
        "form": form if form.is_bound else AuditFilterForm(event_types=event_types),
        "events": page.items,
        "next_before": page.next.removeprefix("s") if page.next else None,
        "query": query_without(request, "before"),
        "export_query": query_without(request, "before"),
    }
    return render_fragment_or_page(request, "audit/audit.html", context, partial="list")


@console_page
@require_GET
def audit_verify_badge(request: HttpRequest) -> HttpResponse:
    """The chain-verification badge: head hash and count, or the first bad seq."""
    forbid_unless_reader(request, _READERS_ONLY)
    verify = audit_chain_status(fresh=request.GET.get("fresh") == "1")
    return render(request, "audit/partials/_verify.html", {"verify": verify})


@console_page
@require_GET
def audit_export(request: HttpRequest) -> StreamingHttpResponse:
    """The filtered events as JSON Lines (the API's representation), oldest first,
    streamed (no full load in memory)."""
    forbid_unless_reader(request, _READERS_ONLY)
    filters = _filters(AuditFilterForm(request.GET or None))
    audit_link()  # then every event up to the head is exported linked
    events = selectors.audit_queryset(filters).order_by("seq")

    def lines() -> Iterator[str]:
        for event in events.iterator(chunk_size=2000):
            yield event_jsonl(event)

    response = StreamingHttpResponse(lines(), content_type="application/jsonl; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="airlock-audit.jsonl"'
    return response
