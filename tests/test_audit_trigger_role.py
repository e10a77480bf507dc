"""The append-only trigger's maintenance switch works for superusers only."""

from __future__ import annotations

import pytest
from django.db.utils import DatabaseError

from audit.models import AuditEvent
from audit.services import Actor, audit_append
from tests.fixtures.audit import ordinary_role_in_maintenance

pytestmark = pytest.mark.django_db


def test_an_ordinary_role_cannot_delete_audit_rows_even_with_the_maintenance_setting() -> None:
    audit_append(event_type="test.event", actor=Actor.system(), details={})
    with (
        pytest.raises(DatabaseError, match="append-only"),
        ordinary_role_in_maintenance("audit_auditevent") as cursor,
    ):
        cursor.execute("DELETE FROM audit_auditevent")
    assert AuditEvent.objects.count() == 1
