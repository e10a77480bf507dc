"""The append-only trigger's maintenance switch works for superusers only."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.db.utils import DatabaseError

from audit.models import AuditEvent
from audit.services import Actor, audit_append

pytestmark = pytest.mark.django_db


def test_an_ordinary_role_cannot_delete_audit_rows_even_with_the_maintenance_setting() -> None:
    audit_append(event_type="test.event", actor=Actor.system(), details={})
    with connection.cursor() as cursor:
        cursor.execute(
            "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = "
            "'airlock_app_role_test') THEN CREATE ROLE airlock_app_role_test NOLOGIN; "
            "END IF; END $$"
        )
        cursor.execute("GRANT ALL ON audit_auditevent TO airlock_app_role_test")
    with (
        pytest.raises(DatabaseError, match="append-only"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute("SET LOCAL airlock.audit_maintenance = 'on'")
        cursor.execute("SET LOCAL ROLE airlock_app_role_test")
        cursor.execute("DELETE FROM audit_auditevent")
    assert AuditEvent.objects.count() == 1
