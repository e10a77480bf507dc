"""Conflicts (three-way resolution), resources, conflict classes and resource kinds."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.db.models import OuterRef, Q, QuerySet, Subquery
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, QueryDict
from django.shortcuts import get_object_or_404, render
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from approvals.models import ClaimSubject, Operation
from approvals.services.claims import claim_end_on_decision
from approvals.services.undo import action_undo_request, operations_open_to_undo
from approvals.views.claims import conflict_claim_rows
from audit.services import Actor
from console import permissions
from console.pages import (
    EVENT_COUNTS,
    after_post,
    console_page,
    error_status,
    forbid_unless,
    is_htmx,
    pretty,
    raise_if_denied,
    render_fragment_or_page,
    render_list_page,
)
from engine.core.errors import DomainError, NotFound
from ownership.diff import (
    default_choice,
    document_diff,
    element_diff,
    proposed_document,
    side_by_side,
    three_way_diff,
)
from ownership.forms import (
    ResolutionForm,
    ResourceFilterForm,
    UndoForm,
)
from ownership.history import revision_at
from ownership.models import (
    Conflict,
    ConflictClass,
    ConflictStatus,
    OwnershipRecord,
    ResolutionChoice,
    Resource,
    ResourceKind,
    ResourceVersion,
)
from ownership.selectors import (
    conflict_get_for_person,
    conflict_list_for_person,
    conflict_may_resolve,
    resource_list,
)
from ownership.services.resolution import conflict_merge_preview, conflict_resolve

EVENT_CONFLICTS = "conflicts-changed"


# --- conflicts ---------------------------------------------------------------------------


def _show(row: dict[str, Any], side: str) -> str:
    return pretty(row[side]) if row.get(f"{side}_present", True) else "(absent)"


def _field_rows(conflict: Conflict) -> list[dict[str, Any]]:
    """The engine's field-level three-way diff, with display text and default choice."""

    fields = conflict.fields or three_way_diff(
        conflict.base_document, conflict.current_document, conflict.proposed_document
    )
    rows = []
    for field in fields:
        row = dict(field)
        row["base_text"] = _show(row, "base")
        row["current_text"] = _show(row, "current")
        row["proposed_text"] = _show(row, "proposed")
        row["default"] = default_choice(row["change"])
        for side in ("current", "proposed"):
            row[f"{side}_mark"] = _mark(row, side)
            # Two arrays: which elements this side added or removed since the base.
            row[f"{side}_elements"] = (
                element_diff(row["base"], row[side]) if row[f"{side}_mark"] == "changed" else None
            )
        row["kept"] = _kept_side(conflict, row)
        rows.append(row)
    return rows


def _mark(row: dict[str, Any], side: str) -> str:
    """How `side`'s value relates to the base's: same, added, removed or changed
    (the page shows it as a word, not as a colour alone)."""
    base_present, present = row["base_present"], row[f"{side}_present"]
    if base_present and not present:
        return "removed"
    if present and not base_present:
        return "added"
    return "same" if row[side] == row["base"] else "changed"


def _kept_side(conflict: Conflict, row: dict[str, Any]) -> str:
    """A resolved conflict: which side this field took ("" while open)."""
    if conflict.status != ConflictStatus.RESOLVED:
        return ""
    if conflict.resolution == ResolutionChoice.KEEP_CURRENT:
        return "current"
    if conflict.resolution == ResolutionChoice.TAKE_PROPOSED:
        return "proposed"
    choices = conflict.resolution_fields if isinstance(conflict.resolution_fields, dict) else {}
    return str(choices.get(row["path"]) or default_choice(row["change"]))


def _resolution_result(conflict: Conflict) -> dict[str, Any] | None:
    """What a resolved conflict left: the document its resolution writes (None: it
    deletes the resource), or the current document when it keeps it. None while open."""
    if conflict.status != ConflictStatus.RESOLVED:
        return None
    action = conflict.resolution_action
    if action is None:
        return {"text": pretty(conflict.current_document), "deletes": False}
    deletes = action.operation == "delete"
    document = {} if deletes else proposed_document(action, conflict.current_document)
    return {"text": pretty(document), "deletes": deletes}


def _conflict_for(user: Any, conflict_id: uuid.UUID) -> Conflict:
    try:
        return conflict_get_for_person(user, conflict_id)
    except NotFound as exc:
        raise Http404(exc.message) from exc


def _preview(conflict: Conflict, choices: dict[str, str] | None) -> str:
    return pretty(conflict_merge_preview(conflict=conflict, fields=choices))


def with_undo_request(conflicts: QuerySet[Conflict]) -> QuerySet[Conflict]:
    """Each conflict with who asked for its undo (an undo's conflict is a person's or a
    plan's act, not the agent's stale write): the latest undo operation of its action
    records the requester at acceptance; `undone_version` is what the undone write made."""
    undo = Operation.objects.filter(action_id=OuterRef("action_id"), undo_of__isnull=False)
    latest = undo.order_by("-started_at", "-pk")
    return conflicts.annotate(
        undo_requested_by=Subquery(latest.values("outcome__requested_by")[:1]),
        undo_requested_by_type=Subquery(latest.values("outcome__requested_by_type")[:1]),
        undo_reason=Subquery(latest.values("outcome__requested_reason")[:1]),
        undone_version=Subquery(latest.values("undo_of__result_version")[:1]),
    )


def _conflict_context(request: HttpRequest, conflict: Conflict, **extra: Any) -> dict[str, Any]:
    conflict = (
        with_undo_request(Conflict.objects.filter(pk=conflict.pk))
        .select_related(
            "action__run__agent", "resource", "conflict_class", "resolved_by", "resolution_action"
        )
        .get()
    )
    rows = _field_rows(conflict)
    may_resolve = conflict_may_resolve(conflict=conflict, person=request.user)
    # Who wrote the current version, from which run.
    current_writer = revision_at(conflict.resource, conflict.current_version)
    return {
        "nav": "conflicts",
        "conflict": conflict,
        "rows": rows,
        "may_resolve": may_resolve,
        "resolver_group": conflict.resolver_group,
        "current_writer": current_writer,
        "preview": _preview(conflict, None),
        # The toggle's whole documents: what is there now against what was proposed.
        "whole_documents": side_by_side(conflict.current_document, conflict.proposed_document),
        "result": _resolution_result(conflict),
        "form": ResolutionForm(),
        **extra,
    }


# The conflicts list's age filter: opened longer ago than this.
CONFLICT_AGES = {
    "1h": ("older than an hour", timedelta(hours=1)),
    "1d": ("older than a day", timedelta(days=1)),
    "7d": ("older than a week", timedelta(days=7)),
}


def _filter_conflicts(
    conflicts: QuerySet[Conflict], *, cls: str, group: str, age: str
) -> QuerySet[Conflict]:
    """The list's GET filters: class, resolver group and age (an unknown age is none)."""
    if cls:
        conflicts = conflicts.filter(conflict_class_id=cls)
    if group:
        conflicts = conflicts.filter(resolver_group=group)
    if age in CONFLICT_AGES:
        conflicts = conflicts.filter(created_at__lte=timezone.now() - CONFLICT_AGES[age][1])
    return conflicts


def _conflicts_page(request: HttpRequest, query: Any, **extra: Any) -> HttpResponse:
    """The conflicts list for the filters in `query` (the GET of the page)."""
    user = request.user
    scope = query.get("scope", "mine")
    status = query.get("status", "open")
    cls, group, age = (query.get(name, "")[:150] for name in ("class", "group", "age"))

    visible = conflict_list_for_person(
        user,
        mine=scope != "all",
        status=status if status in ConflictStatus.values else None,
    )
    conflicts = with_undo_request(_filter_conflicts(visible, cls=cls, group=group, age=age))
    context = {
        "nav": "conflicts",
        "scope": scope,
        "status": status,
        "chosen": {"class": cls, "group": group, "age": age},
        "classes": list(ConflictClass.objects.order_by("slug").values_list("slug", flat=True)),
        # The resolver groups of the conflicts this person may see (a select, not free text).
        "groups": sorted(
            set(
                conflict_list_for_person(user)
                .exclude(resolver_group="")
                .values_list("resolver_group", flat=True)
                .distinct()
            )
        ),
        "ages": [(key, label) for key, (label, _) in CONFLICT_AGES.items()],
        # Which rows offer a checkbox for the bulk "keep current" (the service checks again).
        "my_groups": permissions.user_groups(user) if user.is_active else frozenset(),
        "bulk_limit": BULK_LIMIT,
        **extra,
    }
    return render_list_page(
        request,
        "ownership/conflicts.html",
        conflicts,
        context,
        rows="conflicts",
        page_context=conflict_claim_rows,  # who is on each open conflict ("On it")
    )


@console_page
@require_GET
def conflicts_list(request: HttpRequest) -> HttpResponse:
    response = _conflicts_page(request, request.GET)
    if is_htmx(request) and request.headers.get("HX-Trigger") == "conflict-filters":
        # The filter form sends its empty fields too: the address pushed into the history
        # (what a bookmark keeps) names only the filters chosen. (The list's own refresh
        # on conflicts-changed pushes nothing.)
        chosen = {k: v for k, v in request.GET.items() if v and k != "cursor"}
        url = reverse("conflicts")
        response["HX-Push-Url"] = f"{url}?{urlencode(chosen)}" if chosen else url
    return response


# At most this many conflicts in one bulk resolution (each is its own transaction).
BULK_LIMIT = 100


@console_page
@require_POST
def conflicts_keep_current(request: HttpRequest) -> HttpResponse:
    """Bulk "keep current" with one comment: each selected conflict resolved by the
    resolution service on its own (its lock, its authorisation, its audit event), so one
    refused conflict (another group's, already resolved, the person's own undo) leaves
    the others resolved and is reported by name. Keep current writes nothing."""
    ids = request.POST.getlist("conflict")
    comment = request.POST.get("comment", "").strip()
    back = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(back, allowed_hosts=None) or not back.startswith("/"):
        back = reverse("conflicts")
    problem = (
        "Select at least one conflict."
        if not ids
        else f"Select at most {BULK_LIMIT} conflicts at once."
        if len(ids) > BULK_LIMIT
        else "Write the comment recorded on each resolution."
        if not comment
        else ""
    )
    if problem:
        response = _conflicts_page(request, QueryDict(back.partition("?")[2]), page_error=problem)
        response.status_code = 422
        return response
    kept, refused = 0, []
    for conflict_id in dict.fromkeys(ids):  # a repeated id once
        try:
            conflict_resolve(
                conflict_id=conflict_id,
                actor=Actor.person(request.user),
                choice=ResolutionChoice.KEEP_CURRENT,
                fields={},
                comment=comment,
            )
            kept += 1
        except DomainError as exc:
            refused.append(f"{conflict_id[:8]}: {exc.message}")
    if kept:
        messages.success(
            request, f"Kept the current document for {kept} conflict{pluralize(kept)}."
        )
    for line in refused:
        messages.error(request, f"Not resolved — conflict {line}")
    return HttpResponseRedirect(back)


@console_page
@require_GET
def conflict_detail(request: HttpRequest, conflict_id: uuid.UUID) -> HttpResponse:
    conflict = _conflict_for(request.user, conflict_id)
    return render(request, "ownership/conflict.html", _conflict_context(request, conflict))


def _choices_from(request: HttpRequest, conflict: Conflict) -> dict[str, str]:
    choices = {}
    for row in _field_rows(conflict):
        value = request.POST.get(f"field:{row['path']}", row["default"])
        choices[row["path"]] = value if value in ("current", "proposed") else row["default"]
    return choices


@console_page
@require_http_methods(["POST"])
def conflict_preview(request: HttpRequest, conflict_id: uuid.UUID) -> HttpResponse:
    """The merged document for the choices in the form (no state change)."""
    conflict = _conflict_for(request.user, conflict_id)
    choice = request.POST.get("choice", "merge")
    if choice == "keep_current":
        document: Any = conflict.current_document
    elif choice == "take_proposed":
        document = conflict.proposed_document
    else:
        return render(
            request,
            "ownership/conflict.html#preview",
            {"preview": _preview(conflict, _choices_from(request, conflict))},
        )
    return render(request, "ownership/conflict.html#preview", {"preview": pretty(document)})


@console_page
@require_POST
def conflict_resolve_view(request: HttpRequest, conflict_id: uuid.UUID) -> HttpResponse:
    conflict = _conflict_for(request.user, conflict_id)
    forbid_unless(
        conflict_may_resolve(conflict=conflict, person=request.user),
        "Only the resolver group of this conflict may resolve it.",
    )
    form = ResolutionForm(request.POST)
    if not form.is_valid():
        context = _conflict_context(request, conflict, form=form)
        return render_fragment_or_page(
            request, "ownership/conflict.html", context, partial="page", status=422
        )
    choice = form.cleaned_data["choice"]
    fields = _choices_from(request, conflict) if choice == "merge" else {}

    try:
        conflict_resolve(
            conflict_id=conflict.id,
            actor=Actor.person(request.user),
            choice=choice,
            fields=fields,
            comment=form.cleaned_data["comment"],
        )
        # Resolved: whoever was on it is no longer (audited `claim.released`).
        claim_end_on_decision(
            subject=ClaimSubject.CONFLICT, subject_id=conflict.id, person=request.user
        )
    except DomainError as exc:
        context = _conflict_context(request, conflict, form=form, error=exc.message)
        return render_fragment_or_page(
            request,
            "ownership/conflict.html",
            context,
            partial="page",
            status=error_status(exc),
        )
    if not is_htmx(request):
        messages.success(request, "Conflict resolved.")

    def fragment() -> HttpResponse:
        fresh = _conflict_for(request.user, conflict.id)
        return render(request, "ownership/conflict.html#page", _conflict_context(request, fresh))

    return after_post(
        request,
        redirect_to=reverse("conflict_detail", args=[conflict.id]),
        fragment=fragment,
        trigger=(EVENT_COUNTS, EVENT_CONFLICTS),
    )


# --- resources ----------------------------------------------------------------------------


@console_page
@require_GET
def resources_list(request: HttpRequest) -> HttpResponse:
    form = ResourceFilterForm(request.GET or None)
    # Every signed-in person reads resources (as with a personal token in the API).
    resources = resource_list()
    if form.is_valid():
        if form.cleaned_data.get("kind"):
            resources = resources.filter(kind_id=form.cleaned_data["kind"])
        if form.cleaned_data.get("prefix"):
            resources = resources.filter(name__startswith=form.cleaned_data["prefix"])
    context = {
        "nav": "resources",
        "kinds": list(ResourceKind.objects.values_list("slug", flat=True)),
        "form": form if form.is_bound else ResourceFilterForm(),
    }
    return render_list_page(
        request,
        "ownership/resources.html",
        resources.only("id", "kind_id", "name", "version", "owner_group", "updated_at", "deleted"),
        context,
        rows="resources",
        fields=("updated_at", "id"),
    )


def _resource_for(user: Any, identifier: str) -> Resource:
    kind, sep, name = identifier.partition("/")
    if not sep or not name:
        raise Http404("No such resource")
    return get_object_or_404(resource_list().select_related("kind"), kind_id=kind, name=name)


def _resource_context(request: HttpRequest, resource: Resource, **extra: Any) -> dict[str, Any]:
    now = timezone.now()
    versions = list(
        ResourceVersion.objects.filter(resource=resource)
        .select_related("run__agent", "person")
        .order_by("-version")[:31]
    )
    history = []
    for index, version in enumerate(versions[:30]):
        previous = versions[index + 1] if index + 1 < len(versions) else None
        history.append(
            {
                "v": version,
                "diff": document_diff(
                    None if previous is None or previous.deleted else previous.document,
                    None if version.deleted else version.document,
                )
                if previous is not None
                else None,
            }
        )
    records = [
        r
        for r in OwnershipRecord.objects.filter(kind_id=resource.kind_id, active=True)
        .filter(Q(name=resource.name) | Q(is_prefix=True))
        .select_related("run__agent")
        if r.name == resource.name or (r.is_prefix and resource.name.startswith(r.name))
    ]
    undoable = list(
        operations_open_to_undo()
        .filter(action__resource=resource, undo_deadline__gt=now)
        .select_related("action__run__agent")
        .order_by("-finished_at")[:20]
    )
    # An undo restores the document from before the write only while the resource is
    # still at the version the write produced; after a later write it becomes a conflict
    # for a person, and the button says so before it is pressed: (operation, moved to).
    undo_rows = [
        (op, resource.token if op.result_version != resource.token else None) for op in undoable
    ]
    may_undo = permissions.can_undo_as_person(request.user, owner_group=resource.owner_group)
    return {
        "nav": "resources",
        "resource": resource,
        "document": pretty(resource.document),
        "history": history,
        "records": records,
        "undoable": undo_rows,
        "may_undo": may_undo,
        "now": now,
        **extra,
    }


@console_page
@require_GET
def resource_detail(request: HttpRequest, identifier: str) -> HttpResponse:
    resource = _resource_for(request.user, identifier)
    return render(request, "ownership/resource.html", _resource_context(request, resource))


@console_page
@require_POST
def operation_undo(request: HttpRequest, operation_id: int) -> HttpResponse:
    """Ask for the undo of one applied write (the engine runs it through the barrier)."""
    operation = Operation.objects.select_related("action__resource").filter(pk=operation_id).first()
    if operation is None or operation.action.resource is None:
        raise Http404("No such operation")
    resource = _resource_for(request.user, operation.action.resource.identifier)

    def respond(notice: str, *, error: bool = False, status: int = 200) -> HttpResponse:
        if is_htmx(request):
            key = "page_error" if error else "page_notice"
            context = _resource_context(request, resource, **{key: notice})
            response = render(request, "ownership/resource.html#page", context, status=status)
            if not error:
                response["HX-Trigger"] = json.dumps({EVENT_COUNTS: True})
            return response
        (messages.error if error else messages.success)(request, notice)
        return HttpResponseRedirect(reverse("resource_detail", args=[resource.identifier]))

    form = UndoForm(request.POST)
    if not form.is_valid():
        problem = (
            "The reason is longer than 500 characters."
            if "reason" in form.errors
            else "Tick the confirmation box to undo."
        )
        return respond(problem, error=True, status=422)
    try:
        # The service decides who may undo (operators, the resource's owner group).
        action_undo_request(
            action_id=operation.action_id,
            actor=Actor.person(request.user),
            reason=form.cleaned_data["reason"],
        )
    except DomainError as exc:
        raise_if_denied(exc)
        return respond(exc.message, error=True, status=error_status(exc))
    return respond(f"Undo of version {operation.result_version} requested.")
