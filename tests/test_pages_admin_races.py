"""Two admins at once: the rule and people services serialise on the row, so a
repeated change lands once and is audited once. The collision is forced: the
test holds the row lock while both admins' calls queue behind it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction

from approvals.models import AutoApproveRule
from approvals.services.rules import auto_approve_rule_delete, auto_approve_rule_update
from audit.models import AuditEvent
from audit.services import Actor
from console.people import person_set_active
from ownership.models import ResourceKind
from tests.fixtures.console import People

pytestmark = pytest.mark.django_db(transaction=True)


def _collide(model: Any, pk: int, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` in threads while this thread holds the row's lock, then let go."""
    results: list[Any] = []
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        try:
            results.append(call())
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    with transaction.atomic():
        model.objects.select_for_update().get(pk=pk)
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # both are now waiting on the row lock
        assert not results, "a call did not wait for the row lock"
    for thread in threads:
        thread.join(timeout=20)
    assert not errors, errors
    return results


def _rule(kind: ResourceKind) -> AutoApproveRule:
    return AutoApproveRule.objects.create(kind=kind, name_prefix="sbx-", operations=["update"])


def test_two_admins_disabling_the_same_rule_write_one_audit_row(people: People) -> None:
    kind = _any_kind()
    rule = _rule(kind)
    second_admin = User.objects.create_user(username="ada2")
    second_admin.groups.set(people.admin.groups.all())

    def disable(user: User) -> Callable[[], Any]:
        return lambda: auto_approve_rule_update(
            actor=Actor.person(user),
            rule_id=rule.pk,
            kind=kind.slug,
            name_prefix="sbx-",
            operations=["update"],
            enabled=False,
        )[1]

    changed = _collide(AutoApproveRule, rule.pk, [disable(people.admin), disable(second_admin)])
    assert sorted(changed) == [False, True]
    assert AuditEvent.objects.filter(event_type="auto_approve_rule.updated").count() == 1


def test_two_admins_deleting_the_same_rule_write_one_audit_row(people: People) -> None:
    rule = _rule(_any_kind())
    deleted = _collide(
        AutoApproveRule,
        rule.pk,
        [lambda: auto_approve_rule_delete(actor=Actor.person(people.admin), rule_id=rule.pk)] * 2,
    )
    assert sorted(deleted) == [False, True]
    assert AuditEvent.objects.filter(event_type="auto_approve_rule.deleted").count() == 1


def test_two_admins_deactivating_the_same_person_write_one_audit_row(people: People) -> None:
    deactivate = lambda: person_set_active(  # noqa: E731
        user=people.admin, person_id=people.owner.pk, active=False
    )[1]
    changed = _collide(User, people.owner.pk, [deactivate, deactivate])
    assert sorted(changed) == [False, True]
    assert AuditEvent.objects.filter(event_type="person.deactivated").count() == 1


def _any_kind() -> ResourceKind:
    kind = ResourceKind.objects.first()
    if kind is None:
        from ownership.models import ConflictClass

        shared = ConflictClass.objects.get(slug="replace_shared_document")
        kind = ResourceKind.objects.create(
            slug="sandbox-thing",
            class_create=shared,
            class_update=shared,
            class_delete=shared,
            owner_group="platform",
        )
    return kind
