"""Audit trail pages: filtered list, chain-verification badge, JSON Lines export."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from django.contrib.auth.models import User
from django.core.cache import cache
from django.db.models import Q
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from approvals.models import Agent, Run
from audit.forms import AuditFilterForm
from audit.models import AuditEvent
from audit.selectors import audit_head, audit_queryset, verify_chain
from console import permissions
from console.pages import console_page, forbid_unless, query_without, render_fragment_or_page

PAGE = 50


def _filtered(request: HttpRequest, form: AuditFilterForm) -> Any:
    """The core's audit_queryset for the structured filters, plus agent/person/time."""

    if not form.is_valid():
        return audit_queryset({})
    data = form.cleaned_data
    events = audit_queryset(
        {
            "resource": data.get("resource"),
            "run": data.get("run"),
            "action": data.get("action"),
            "event_type": data.get("type"),
        }
    )
    if data.get("agent"):
        agent = Agent.objects.filter(name=data["agent"]).first()
        if agent is None:
            return events.none()
        runs = Run.objects.filter(agent=agent).values("id")
        events = events.filter(Q(actor_type="agent", actor_id=str(agent.pk)) | Q(run_id__in=runs))
    if data.get("person"):
        person = User.objects.filter(username=data["person"]).first()
        if person is None:
            return events.none()
        events = events.filter(actor_type="person", actor_id=str(person.pk))
    if data.get("since"):
        events = events.filter(created_at__gte=data["since"])
    if data.get("until"):
        events = events.filter(created_at__lt=data["until"])
    return events


def _require_reader(request: HttpRequest) -> None:
    forbid_unless(
        permissions.can_read_everything(request.user),
        "The audit trail is for operators, admins and auditors.",
    )


@console_page
@require_GET
def audit_list(request: HttpRequest) -> HttpResponse:
    _require_reader(request)
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
    }
    return render_fragment_or_page(request, "audit/audit.html", context, partial="list")


# A full walk of a million-event chain takes seconds; the badge reuses the last
# result while the head has not moved, for at most this long.
VERIFY_CACHE_SECONDS = 300
_VERIFY_CACHE_KEY = "airlock:console:audit-verify"


def _verify(*, fresh: bool = False) -> dict[str, Any]:
    """The core's verify_chain, cached per head (seq, hash) for VERIFY_CACHE_SECONDS."""

    head = list(audit_head())
    cached = None if fresh else cache.get(_VERIFY_CACHE_KEY)
    if cached is not None and cached["head"] == head:
        return dict(cached, cached=True)
    result = verify_chain()
    value = {
        "ok": result.ok,
        "events": result.events,
        "first_bad_seq": result.first_bad_seq,
        "head_hash": result.head_hash,
        "problem": result.problem,
        "head": head,
        "checked_at": timezone.now(),
    }
    cache.set(_VERIFY_CACHE_KEY, value, VERIFY_CACHE_SECONDS)
    return dict(value, cached=False)


@console_page
@require_GET
def audit_verify_badge(request: HttpRequest) -> HttpResponse:
    """The chain-verification badge: head hash and count, or the first bad seq."""
    _require_reader(request)
    verify = _verify(fresh=request.GET.get("fresh") == "1")
    return render(request, "audit/partials/_verify.html", {"verify": verify})


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
    _require_reader(request)
    form = AuditFilterForm(request.GET or None)
    events = _filtered(request, form).order_by("seq")

    def lines() -> Iterator[str]:
        for event in events.iterator(chunk_size=2000):
            yield _event_json(event) + "\n"

    response = StreamingHttpResponse(lines(), content_type="application/jsonl; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="airlock-audit.jsonl"'
    return response
