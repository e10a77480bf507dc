"""Audit trail pages: filtered list, chain-verification badge, JSON Lines export."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from django.db.models import CharField, Q, Value
from django.db.models.functions import Concat
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from approvals.models import Run
from audit.forms import AuditFilterForm
from audit.models import AuditEvent
from console import permissions
from console.views import console_page, query_without, render_fragment_or_page
from ownership.models import Resource

PAGE = 50


def events_visible_to(user: Any) -> Any:
    """Everything for operators, admins and auditors; for a resource owner, the
    events about resources of their groups."""
    events = AuditEvent.objects.all()
    if permissions.can_read_everything(user):
        return events
    owned = (
        Resource.objects.filter(owner_group__in=list(permissions.user_groups(user)))
        .annotate(identifier=Concat("kind_id", Value("/"), "name", output_field=CharField()))
        .values("identifier")
    )
    return events.filter(resource__in=owned)


def _filtered(request: HttpRequest, form: AuditFilterForm) -> Any:
    events = events_visible_to(request.user)
    if not form.is_valid():
        return events
    data = form.cleaned_data
    if data.get("resource"):
        events = events.filter(resource=data["resource"])
    if data.get("run"):
        events = events.filter(run_id=data["run"])
    if data.get("action"):
        events = events.filter(action_id=data["action"])
    if data.get("agent"):
        runs = Run.objects.filter(agent__name=data["agent"]).values("id")
        events = events.filter(
            Q(actor_type="agent", actor_label=data["agent"]) | Q(run_id__in=runs)
        )
    if data.get("person"):
        events = events.filter(actor_type="person", actor_label=data["person"])
    if data.get("type"):
        events = events.filter(event_type=data["type"])
    if data.get("since"):
        events = events.filter(created_at__gte=data["since"])
    if data.get("until"):
        events = events.filter(created_at__lt=data["until"])
    return events


@console_page
@require_GET
def audit_list(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET or None)
    events = _filtered(request, form).order_by("-seq")
    before = request.GET.get("before", "")
    if before.isdigit():
        events = events.filter(seq__lt=int(before))
    rows = list(events[: PAGE + 1])
    next_before = None
    if len(rows) > PAGE:
        rows = rows[:PAGE]
        next_before = rows[-1].seq
    context = {
        "nav": "audit",
        "form": form if form.is_bound else AuditFilterForm(),
        "events": rows,
        "next_before": next_before,
        "query": query_without(request, "before"),
        "export_query": query_without(request, "before"),
        "is_reader": permissions.can_read_everything(request.user),
    }
    return render_fragment_or_page(request, "audit/audit.html", context, partial="list")


def _verify() -> dict[str, Any]:
    from audit.chain import verify_rows

    rows = AuditEvent.objects.order_by("seq").iterator(chunk_size=5000)
    result = verify_rows(rows)
    return {
        "ok": result.ok,
        "events": result.events,
        "first_bad_seq": result.first_bad_seq,
        "head_hash": result.head_hash,
        "problem": result.problem,
    }


@console_page
@require_GET
def audit_verify_badge(request: HttpRequest) -> HttpResponse:
    """The chain-verification badge: head hash and count, or the first bad seq."""
    if not permissions.can_read_everything(request.user):
        return render(request, "audit/partials/_verify.html", {"verify": None})
    return render(request, "audit/partials/_verify.html", {"verify": _verify()})


def _event_json(event: AuditEvent) -> str:
    return json.dumps(
        {
            "seq": event.seq,
            "created_at": event.created_at.isoformat(),
            "actor_type": event.actor_type,
            "actor_id": event.actor_id,
            "actor_label": event.actor_label,
            "request_id": event.request_id,
            "event_type": event.event_type,
            "resource": event.resource,
            "run_id": str(event.run_id) if event.run_id else None,
            "action_id": str(event.action_id) if event.action_id else None,
            "details": event.details,
            "prev_hash": event.prev_hash,
            "hash": event.hash,
        },
        ensure_ascii=False,
        sort_keys=True,
    )


@console_page
@require_GET
def audit_export(request: HttpRequest) -> StreamingHttpResponse:
    """The filtered events as JSON Lines, oldest first, streamed (no full load in memory)."""
    form = AuditFilterForm(request.GET or None)
    events = _filtered(request, form).order_by("seq")

    def lines() -> Iterator[str]:
        for event in events.iterator(chunk_size=2000):
            yield _event_json(event) + "\n"

    response = StreamingHttpResponse(lines(), content_type="application/jsonl; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="airlock-audit.jsonl"'
    return response
