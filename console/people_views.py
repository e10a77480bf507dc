"""People pages: admins create people, change their roles and owner groups,
deactivate and reactivate them; auditors read. Every change goes through
console.people (the same verbs `manage.py person_create` calls)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.http import require_GET, require_POST

from console import permissions
from console.forms import PersonCreateForm, PersonUpdateForm
from console.pages import (
    EditablePage,
    console_page,
    error_status,
    forbid_unless,
    render_fragment_or_page,
)
from console.people import person_create, person_groups, person_set_active, person_update
from engine.core.errors import DomainError

PEOPLE = EditablePage(template="console/people.html", url_name="people", event="people-changed")
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
    return render_fragment_or_page(request, PEOPLE.template, context, partial="page")


@console_page
@require_POST
def person_create_view(request: HttpRequest) -> HttpResponse:
    _people_admin(request)
    form = PersonCreateForm(request.POST)

    def save() -> str:
        data = form.cleaned_data
        person = person_create(
            user=request.user,
            username=data["username"],
            password=data["password"],
            roles=list(data["roles"]),
            groups=data["groups"],
        )
        return f"{person.get_username()} can now sign in."

    return PEOPLE.submit(request, form, save, _people_context, create_form=form)


@console_page
@require_POST
def person_update_view(request: HttpRequest, person_id: int) -> HttpResponse:
    _people_admin(request)
    person = User.objects.filter(pk=person_id).first()
    if person is None:
        raise Http404("No such person")
    form = PersonUpdateForm(request.POST)

    def save() -> str:
        _person, changed = person_update(
            user=request.user,
            person_id=person.pk,
            roles=list(form.cleaned_data["roles"]),
            groups=form.cleaned_data["groups"],
        )
        name = person.get_username()
        return f"{name}'s roles and groups saved." if changed else f"{name} is unchanged."

    return PEOPLE.submit(request, form, save, _people_context, edit_form=form, editing=person)


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
            status, error = error_status(exc), exc.message
        else:
            verb = "reactivated" if active == "1" else "deactivated"
            name = person.get_username()
            notice = f"{name} {verb}." if changed else f"{name} was already {verb}."

    def context() -> dict[str, Any]:
        values = _people_context(request)
        values["page_error"] = error
        return values

    return PEOPLE.respond(request, context, notice=notice, status=status)
