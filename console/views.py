"""Console pages: sign-in, dashboard, kill switch, plus the helpers every page uses.

Views are thin: parse, authorise through selectors/permission predicates, call
one service, render. Each view serves the full page and, for htmx requests, the
fragment (``"page.html#partial"``); every mutation also works as a plain form
POST with redirect-after-POST.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_GET, require_POST

from approvals.models import Action, ActionStatus
from approvals.selectors import pending_approval_count
from audit.models import AuditEvent
from console import permissions
from console.core import jsonsafe
from console.core.errors import DomainError
from console.forms import KillSwitchForm, PersonCreateForm, PersonUpdateForm
from console.models import KillSwitch
from console.people import person_create, person_groups, person_set_active, person_update
from console.services import kill_switch_set
from ownership.models import ConflictStatus
from ownership.selectors import conflict_list_for_person, open_conflict_count

V = TypeVar("V", bound=Callable[..., HttpResponseBase])

# Events fired through HX-Trigger after a mutation, so counters and lists refresh.
EVENT_COUNTS = "counts-changed"


def console_page(view: V) -> V:
    """Login required, and the response varies on HX-Request (full page vs fragment)."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        response = view(request, *args, **kwargs)
        patch_vary_headers(response, ("HX-Request",))
        return response

    return login_required(wrapper)  # type: ignore[return-value]


def signed_in(request: HttpRequest) -> User:
    """The signed-in person (console_page guarantees one)."""
    user = request.user
    if not isinstance(user, User):
        raise PermissionDenied("Sign in first.")
    return user


def is_htmx(request: HttpRequest) -> bool:
    """An htmx request that wants a fragment (a history restore wants the whole page)."""
    htmx = getattr(request, "htmx", None)
    return htmx is not None and bool(htmx) and not htmx.history_restore_request


def render_fragment_or_page(
    request: HttpRequest,
    template: str,
    context: dict[str, Any],
    *,
    partial: str,
    status: int = 200,
    trigger: Iterable[str] = (),
) -> HttpResponse:
    """The full page, or only ``template#partial`` for an htmx request."""
    name = f"{template}#{partial}" if is_htmx(request) else template
    response = render(request, name, context, status=status)
    events = list(trigger)
    if events:
        response["HX-Trigger"] = json.dumps(dict.fromkeys(events, True))
    return response


def after_post(
    request: HttpRequest,
    *,
    redirect_to: str,
    fragment: Callable[[], HttpResponse] | None = None,
    trigger: Iterable[str] = (EVENT_COUNTS,),
) -> HttpResponse:
    """Redirect-after-POST for plain forms; the updated fragment for htmx."""
    if is_htmx(request) and fragment is not None:
        response = fragment()
    else:
        response = HttpResponseRedirect(redirect_to)
    events = list(trigger)
    if events:
        response["HX-Trigger"] = json.dumps(dict.fromkeys(events, True))
    return response


def respond_page(
    request: HttpRequest,
    *,
    template: str,
    context: Callable[[], dict[str, Any]],
    redirect_to: str,
    notice: str = "",
    status: int = 200,
    events: Iterable[str] = (),
) -> HttpResponse:
    """The answer to a POST on a page whose body is the ``page`` partial.

    htmx: that partial (with the notice in place) and, on success, HX-Trigger.
    A plain form: redirect-after-POST on success, the whole page with its
    errors (same status) otherwise.
    """
    ok = status < 400
    if is_htmx(request):
        values = context()
        values["page_notice"] = notice if ok else ""
        response = render(request, f"{template}#page", values, status=status)
        names = list(events)
        if ok and names:
            response["HX-Trigger"] = json.dumps(dict.fromkeys(names, True))
        return response
    if ok:
        if notice:
            messages.success(request, notice)
        return HttpResponseRedirect(redirect_to)
    return render(request, template, context(), status=status)


def form_errors_from(form: Any, error: DomainError) -> None:
    """Put a service's ValidationFailed field errors on the form's fields."""
    listed = error.extra.get("errors") if isinstance(error.extra, dict) else None
    if not listed:
        form.add_error(None, error.message)
        return
    for item in listed:
        field = item.get("field")
        form.add_error(field if field in form.fields else None, item.get("message", ""))


def domain_error_status(error: DomainError) -> int:
    return {
        "not_found": 404,
        "forbidden": 403,
        "self_approval": 403,
        "validation_error": 422,
    }.get(error.code, 409)


# --- sign-in -------------------------------------------------------------------


class LoginView(auth_views.LoginView):
    """Django's login; django-axes counts failures and locks the username out."""

    template_name = "registration/login.html"
    redirect_authenticated_user = True
    extra_context = {"failure_limit": settings.AXES_FAILURE_LIMIT}


class LogoutView(auth_views.LogoutView):
    pass


# --- dashboard -----------------------------------------------------------------


def dashboard_counts(user: Any) -> dict[str, Any]:
    """The live numbers on the dashboard: one aggregate over the live action
    statuses (index on status) plus three counts through the selectors."""
    hour_ago = timezone.now() - timedelta(hours=1)
    actions = Action.objects.filter(
        Q(status__in=[ActionStatus.QUEUED, ActionStatus.EXECUTING, ActionStatus.PAUSED])
        | Q(status=ActionStatus.FAILED, updated_at__gte=hour_ago)
    ).aggregate(
        queued=Count("id", filter=Q(status=ActionStatus.QUEUED)),
        executing=Count("id", filter=Q(status=ActionStatus.EXECUTING)),
        paused=Count("id", filter=Q(status=ActionStatus.PAUSED)),
        failed_last_hour=Count("id", filter=Q(status=ActionStatus.FAILED)),
    )

    conflicts_all = conflict_list_for_person(user, status=ConflictStatus.OPEN).count()
    pending = pending_approval_count(user)
    may_decide = permissions.can_decide_approvals(user)
    return {
        "pending_approvals": pending,
        "may_decide": may_decide,
        "conflicts_mine": open_conflict_count(user),
        "conflicts_all": conflicts_all,
        **actions,
    }


def dashboard_context(request: HttpRequest, form: KillSwitchForm | None = None) -> dict[str, Any]:
    user = request.user
    reader = permissions.can_read_everything(user)
    pauses = (
        Action.objects.filter(status=ActionStatus.PAUSED)
        .values("paused_reason")
        .annotate(n=Count("id"))
        .order_by("-n")[:10]
    )
    return {
        "nav": "dashboard",
        "counts": dashboard_counts(user),
        "pauses": list(pauses),
        "switches": list(KillSwitch.objects.select_related("changed_by").order_by("scope")[:50]),
        "may_switch": permissions.is_operator(user),
        "form": form or KillSwitchForm(),
        "recent": list(AuditEvent.objects.order_by("-seq")[:12]) if reader else None,
    }


@console_page
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "console/dashboard.html", dashboard_context(request))


@console_page
@require_GET
def dashboard_counts_fragment(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "console/dashboard.html#counts",
        {"counts": dashboard_counts(request.user)},
    )


@console_page
@require_GET
def nav_count(request: HttpRequest, what: str) -> HttpResponse:
    """A badge in the navigation: approvals waiting for me, or conflicts I may resolve."""

    if what == "approvals":
        count, label = pending_approval_count(request.user), "waiting for you"
    elif what == "conflicts":
        count, label = open_conflict_count(request.user), "for you to resolve"
    else:
        raise Http404("No such counter")
    return render(
        request,
        "console/partials/_nav_count.html",
        {"what": what, "count": count, "label": label},
    )


@console_page
@require_GET
def killswitch_banner(request: HttpRequest) -> HttpResponse:
    return render(request, "console/partials/_banner.html")


@console_page
@require_POST
def killswitch_set(request: HttpRequest) -> HttpResponse:
    """Engage or release one scope (operators and admins; audited by the service)."""
    if not permissions.is_operator(request.user):
        raise PermissionDenied("Only operators and admins may use the kill switch.")
    form = KillSwitchForm(request.POST)
    if not form.is_valid():
        context = dashboard_context(request, form)
        return render_fragment_or_page(
            request, "console/dashboard.html", context, partial="killswitch", status=422
        )

    data = form.cleaned_data
    engaged = data["action"] == "engage"
    try:
        kill_switch_set(
            scope=data["scope"],
            engaged=engaged,
            reason=data["reason"],
            actor=request.user,
        )
    except DomainError as error:
        form.add_error(None, error.message)
        context = dashboard_context(request, form)
        return render_fragment_or_page(
            request,
            "console/dashboard.html",
            context,
            partial="killswitch",
            status=domain_error_status(error),
        )
    verb = "engaged" if engaged else "released"
    messages.success(request, f"Kill switch {verb} for {data['scope']}.")
    return after_post(
        request,
        redirect_to=reverse("dashboard"),
        fragment=lambda: render(
            request, "console/dashboard.html#killswitch", dashboard_context(request)
        ),
    )


def forbid_unless(allowed: bool, why: str) -> None:
    if not allowed:
        raise PermissionDenied(why)


# --- keyset pagination ------------------------------------------------------------

PAGE_SIZE = 50


def _encode_cursor(values: list[Any]) -> str:
    import base64

    raw = json.dumps(values, default=str).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> list[Any] | None:
    import base64
    import binascii

    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = jsonsafe.loads(base64.urlsafe_b64decode(padded.encode()), field="cursor")
    except (ValueError, binascii.Error, DomainError):
        return None
    return values if isinstance(values, list) else None


def keyset_page(
    queryset: Any,
    *,
    cursor: str | None,
    fields: tuple[str, str] = ("created_at", "id"),
    limit: int = PAGE_SIZE,
) -> tuple[list[Any], str | None]:
    """Newest first by (fields[0], fields[1]) descending; a bad cursor starts over.

    Keyset, not OFFSET: page N costs the same as page 1 on a large table.
    """
    first, second = fields
    qs = queryset.order_by(f"-{first}", f"-{second}")
    values = _decode_cursor(cursor) if cursor else None
    if values and len(values) == 2:
        qs = qs.filter(
            Q(**{f"{first}__lt": values[0]}) | Q(**{first: values[0], f"{second}__lt": values[1]})
        )
    rows = list(qs[: limit + 1])
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        last = rows[-1]
        next_cursor = _encode_cursor([getattr(last, first), getattr(last, second)])
    return rows, next_cursor


def query_without(request: HttpRequest, key: str) -> str:
    """The current query string without `key` (for "next page" links keeping filters)."""
    params = request.GET.copy()
    params.pop(key, None)
    return params.urlencode()


# --- documents and diffs (presentation only) ---------------------------------------

_MISSING = object()


def flatten(document: Any, prefix: str = "") -> dict[str, Any]:
    """JSON pointer -> leaf value. Lists are compared as whole values."""
    if isinstance(document, dict) and document:
        out: dict[str, Any] = {}
        for key, value in document.items():
            pointer = f"{prefix}/{str(key).replace('~', '~0').replace('/', '~1')}"
            out.update(flatten(value, pointer))
        return out
    return {prefix or "/": document}


def document_diff(before: Any, after: Any) -> list[dict[str, Any]]:
    """Field-level changes from `before` to `after`, for the pages: path, old, new, kind."""
    if before is None and after is None:
        return []
    left = flatten(before) if before is not None else {}
    right = flatten(after) if after is not None else {}
    rows = []
    for path in sorted(set(left) | set(right)):
        old, new = left.get(path, _MISSING), right.get(path, _MISSING)
        if old == new:
            continue
        kind = "added" if old is _MISSING else "removed" if new is _MISSING else "changed"
        rows.append(
            {
                "path": path,
                "old": None if old is _MISSING else compact(old),
                "new": None if new is _MISSING else compact(new),
                "kind": kind,
            }
        )
    return rows


def compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def proposed_document(action: Any) -> Any:
    """What the resource would hold if `action` were applied to the current document
    (None for a delete), computed by the engine's own function."""
    from ownership.services import proposed_document as engine_proposed

    if action.payload_format == "delete" or action.operation == "delete":
        return None
    resource = action.resource if action.resource_id else None
    current = resource.document if resource is not None and not resource.deleted else {}
    return engine_proposed(action, current)


# --- people (admins manage; auditors read) ------------------------------------------

EVENT_PEOPLE = "people-changed"
PEOPLE_TEMPLATE = "console/people.html"
PEOPLE_PAGE_SIZE = 100


def _people_context(
    request: HttpRequest,
    *,
    create_form: Any = None,
    edit_form: Any = None,
    editing: Any = None,
) -> dict[str, Any]:
    # Keyset by username: page N costs what page 1 does however many people there are.
    after = request.GET.get("after", "")
    people = User.objects.prefetch_related("groups").order_by("username")
    if after:
        people = people.filter(username__gt=after)
    persons = list(people[: PEOPLE_PAGE_SIZE + 1])
    next_after = persons[PEOPLE_PAGE_SIZE - 1].username if len(persons) > PEOPLE_PAGE_SIZE else ""
    persons = persons[:PEOPLE_PAGE_SIZE]
    by_group = {group: role for role, group in permissions.ROLES.items()}
    rows = []
    for person in persons:
        names = sorted(g.name for g in person.groups.all())
        rows.append(
            {
                "person": person,
                "roles": [by_group[n] for n in names if n in by_group],
                "groups": [n for n in names if n not in by_group],
            }
        )
    if editing is not None and edit_form is None:
        roles, groups = person_groups(editing)
        edit_form = PersonUpdateForm(initial={"roles": roles, "groups": " ".join(groups)})
    return {
        "nav": "people",
        "rows": rows,
        "next_after": next_after,
        "is_admin": permissions.is_admin(request.user),
        "create_form": create_form or PersonCreateForm(),
        "edit_form": edit_form,
        "editing": editing,
    }


def _people_visible(request: HttpRequest) -> None:
    forbid_unless(
        permissions.is_admin(request.user) or permissions.is_auditor(request.user),
        "Only admins (and auditors, read-only) see people.",
    )


def _people_admin(request: HttpRequest) -> None:
    forbid_unless(permissions.is_admin(request.user), "Only admins manage people.")


@console_page
@require_GET
def people_page(request: HttpRequest) -> HttpResponse:
    _people_visible(request)
    editing = None
    edit = request.GET.get("edit", "")
    if edit.isdigit() and permissions.is_admin(request.user):
        editing = User.objects.filter(pk=int(edit)).first()
    context = _people_context(request, editing=editing)
    return render_fragment_or_page(request, PEOPLE_TEMPLATE, context, partial="page")


@console_page
@require_POST
def person_create_view(request: HttpRequest) -> HttpResponse:
    _people_admin(request)
    form = PersonCreateForm(request.POST)
    status, notice = 200, ""
    if not form.is_valid():
        status = 422
    else:
        data = form.cleaned_data
        try:
            person = person_create(
                user=request.user,
                username=data["username"],
                password=data["password"],
                roles=list(data["roles"]),
                groups=data["groups"],
            )
        except DomainError as exc:
            form_errors_from(form, exc)
            status = domain_error_status(exc)
        else:
            notice = f"{person.get_username()} can now sign in."
    return respond_page(
        request,
        template=PEOPLE_TEMPLATE,
        context=lambda: _people_context(request, create_form=form if status >= 400 else None),
        redirect_to=reverse("people"),
        notice=notice,
        status=status,
        events=(EVENT_PEOPLE,),
    )


@console_page
@require_POST
def person_update_view(request: HttpRequest, person_id: int) -> HttpResponse:
    _people_admin(request)
    person = User.objects.filter(pk=person_id).first()
    if person is None:
        raise Http404("No such person")
    form = PersonUpdateForm(request.POST)
    status, notice = 200, ""
    if not form.is_valid():
        status = 422
    else:
        try:
            _person, changed = person_update(
                user=request.user,
                person_id=person.pk,
                roles=list(form.cleaned_data["roles"]),
                groups=form.cleaned_data["groups"],
            )
        except DomainError as exc:
            form_errors_from(form, exc)
            status = domain_error_status(exc)
        else:
            name = person.get_username()
            notice = f"{name}'s roles and groups saved." if changed else f"{name} is unchanged."
    failed = status >= 400
    return respond_page(
        request,
        template=PEOPLE_TEMPLATE,
        context=lambda: _people_context(
            request, edit_form=form if failed else None, editing=person if failed else None
        ),
        redirect_to=reverse("people"),
        notice=notice,
        status=status,
        events=(EVENT_PEOPLE,),
    )


@console_page
@require_POST
def person_active_view(request: HttpRequest, person_id: int) -> HttpResponse:
    _people_admin(request)
    if not User.objects.filter(pk=person_id).exists():
        raise Http404("No such person")
    active = request.POST.get("active")
    status, notice, error = 200, "", ""
    if active not in ("0", "1"):
        status, error = 422, "Say whether to activate (1) or deactivate (0)."
    else:
        try:
            person, changed = person_set_active(
                user=request.user, person_id=person_id, active=active == "1"
            )
        except DomainError as exc:
            status, error = domain_error_status(exc), exc.message
        else:
            verb = "reactivated" if active == "1" else "deactivated"
            name = person.get_username()
            notice = f"{name} {verb}." if changed else f"{name} was already {verb}."

    def context() -> dict[str, Any]:
        values = _people_context(request)
        values["page_error"] = error
        return values

    return respond_page(
        request,
        template=PEOPLE_TEMPLATE,
        context=context,
        redirect_to=reverse("people"),
        notice=notice,
        status=status,
        events=(EVENT_PEOPLE,),
    )
