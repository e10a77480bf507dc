"""The append-only trigger's maintenance switch works for superusers only."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from audit.services import Actor, audit_append
from tests.fixtures.audit import assert_an_ordinary_role_is_refused

pytestmark = pytest.mark.django_db


def test_an_ordinary_role_cannot_delete_audit_rows_even_with_the_maintenance_setting() -> None:
    audit_append(event_type="test.event", actor=Actor.system(), details={})
    assert_an_ordinary_role_is_refused(
        "DELETE FROM audit_auditevent", table="audit_auditevent", match="append-only"
    )
    assert AuditEvent.objects.count() == 1
