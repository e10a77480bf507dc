"""Conflict classes and resource kinds (the catalog page): everyone reads, admins edit
through the audited catalog services; each kind shows its target and what it enforces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import models
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET, require_POST

from audit.services import Actor
from console import permissions
from console.pages import EditablePage, console_page, render_fragment_or_page
from ownership.forms import CatalogRowForm, ConflictClassForm, ResourceKindForm
from ownership.models import ConflictClass, ResourceKind
from ownership.services import catalog as catalog_services

CATALOG = EditablePage(
    template="ownership/catalog.html", url_name="catalog", event="catalog-changed"
)


def _catalog_context(request: HttpRequest, **extra: Any) -> dict[str, Any]:
    classes = list(ConflictClass.objects.order_by("slug"))
    kinds = list(
        ResourceKind.objects.select_related("class_create", "class_update", "class_delete")
    )
    # What each kind's target enforces itself, and its settings (names only: a kind's settings
    # hold no credential, only the environment variable that does).
    kind_rows = [
        (
            kind,
            {
                "capabilities": catalog_services.kind_capabilities(kind),
                "settings": sorted(kind.target_settings.items()),
            },
        )
        for kind in kinds
    ]
    return {
        "nav": "catalog",
        "kind_rows": kind_rows,
        "classes": classes,
        "kinds": kinds,
        "is_admin": permissions.is_admin(request.user),
        "class_form": ConflictClassForm(),
        "kind_form": ResourceKindForm(),
        **extra,
    }


@console_page
@require_GET
def catalog(request: HttpRequest) -> HttpResponse:
    context = _catalog_context(request)
    # ?edit_class=<slug> / ?edit_kind=<slug>: that row's form, filled in, for an admin.
    editable: tuple[tuple[str, type[CatalogRowForm], type[models.Model]], ...] = (
        ("edit_class", ConflictClassForm, ConflictClass),
        ("edit_kind", ResourceKindForm, ResourceKind),
    )
    for param, form_class, model in editable:
        slug = request.GET.get(param)
        row = (
            model._default_manager.filter(slug=slug).first()
            if slug and context["is_admin"]
            else None
        )
        if row is not None:
            context[form_class.context_name] = form_class(initial=form_class.initial_from(row))
    return render_fragment_or_page(request, CATALOG.template, context, partial="page")


def _catalog_row_view(
    form_class: type[CatalogRowForm], save_row: Callable[..., object]
) -> Callable[[HttpRequest], HttpResponse]:
    """The POST of one catalog table's form: its audited save verb, then the page."""

    @console_page
    @require_POST
    def view(request: HttpRequest) -> HttpResponse:
        form = form_class(request.POST)

        def save() -> str:
            slug, data = form.row_data()
            save_row(slug=slug, data=data, actor=Actor.person(request.user))
            return f"{form_class.noun} {slug} saved."

        # The verb's admin check is a 403 page, not a form error.
        return CATALOG.submit(
            request,
            form,
            save,
            _catalog_context,
            denied_as_page=True,
            **{form_class.context_name: form},
        )

    return view


conflict_class_save = _catalog_row_view(ConflictClassForm, catalog_services.conflict_class_save)
resource_kind_save = _catalog_row_view(ResourceKindForm, catalog_services.resource_kind_save)
