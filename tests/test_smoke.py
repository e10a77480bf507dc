from __future__ import annotations

import pytest

from audit.chain import verify_rows
from audit.linker import audit_link
from audit.models import AuditEvent
from audit.services import Actor, audit_append
from ownership.models import ConflictClass

pytestmark = pytest.mark.django_db


def test_the_five_seeded_conflict_classes_exist() -> None:
    assert set(ConflictClass.objects.values_list("slug", flat=True)) >= {
        "add_unique",
        "recompute_field",
        "advance_pointer",
        "access_change",
        "replace_shared_document",
    }


def test_appended_events_form_a_verifying_chain() -> None:
    for n in range(3):
        audit_append(event_type="test.event", actor=Actor.system(), details={"n": n})
    audit_link()
    result = verify_rows(AuditEvent.objects.order_by("seq"))
    assert result.ok and result.events == 3


def test_the_models_and_the_migrations_agree() -> None:
    """A model change without its migration (or a migration whose state the model does not
    follow) would be made by the next `makemigrations`, on whoever runs it next."""
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exit_:
        pytest.fail(f"makemigrations would write a migration ({exit_.code}):\n{out.getvalue()}")
