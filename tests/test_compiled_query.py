"""console/compiled_query.py: a queryset built and compiled once, run with each call's values,
gives what the ORM gives (issue 41: the proposal's and the token lookup's statements)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import Count, Q, Value
from django.db.models.signals import post_save, pre_save
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from approvals.api.serialize import action_load, with_body_facts
from approvals.models import Action, IdempotencyRecord, IdempotencyStatus, Run
from approvals.selectors import actions_visible_to
from approvals.services import actions, tokens
from approvals.services.queued_writes import in_flight_on, writes_in_flight
from console.compiled_query import CompiledInsert, CompiledQuery, CompiledUpdate, Param
from engine.core import row_locks
from ownership.models import OwnershipRecord, Resource, ResourceKind, ResourceVersion
from tests.fixtures.api import AgentActor, make_active_run, make_agent_with_token
from tests.fixtures.core import applied_prod_alerts_action, make_resource

pytestmark = pytest.mark.django_db

_NAME = Resource._meta.get_field("name")
_KIND = ResourceKind._meta.get_field("slug")


def _fields(instance: Any) -> dict[str, Any]:
    return {field.attname: getattr(instance, field.attname) for field in instance._meta.fields}


def test_each_call_runs_its_own_values_and_the_queryset_is_built_once() -> None:
    make_resource("dns-record/app-a", {"ttl": 1}, version=3)
    make_resource("dns-record/app-b", {"ttl": 2}, version=5)
    built: list[int] = []

    def build() -> Any:
        built.append(1)
        return Resource.objects.filter(kind_id=Param("kind", _KIND), name=Param("name", _NAME))

    query = CompiledQuery(build)
    a = query.get(kind="dns-record", name="app-a")
    b = query.get(kind="dns-record", name="app-b")
    assert (a.document, a.version, b.document, b.version) == ({"ttl": 1}, 3, {"ttl": 2}, 5)
    assert query.first(kind="dns-record", name="app-none") is None
    with pytest.raises(Resource.DoesNotExist):
        query.get(kind="dns-record", name="app-none")
    assert built == [1]
    assert _fields(a) == _fields(Resource.objects.get(pk=a.pk))


def test_the_statement_is_the_orms_and_is_captured_like_it() -> None:
    make_resource("dns-record/app-a", {"ttl": 1}, version=3)
    query = CompiledQuery(
        lambda: Resource.objects.filter(kind_id=Param("kind", _KIND), name=Param("name", _NAME))
    )
    with CaptureQueriesContext(connection) as captured:
        query.all(kind="dns-record", name="app-a")
    assert len(captured.captured_queries) == 1
    assert captured.captured_queries[0]["sql"].startswith('SELECT "ownership_resource"."id"')


def test_an_action_loads_with_its_related_rows_and_annotations_as_through_the_orm(
    run: Any, prod_alerts: Any
) -> None:
    action = applied_prod_alerts_action(run.run)
    compiled = action_load(action.pk)
    orm = with_body_facts(Action.objects.all()).get(pk=action.pk)
    assert _fields(compiled) == _fields(orm)
    assert compiled.run.agent.name == orm.run.agent.name
    assert _fields(compiled.run) == _fields(orm.run)
    for name in ("_write_conflict", "_execution", "_undo_requested"):
        assert getattr(compiled, name) == getattr(orm, name), name
    with pytest.raises(Action.DoesNotExist):
        action_load("00000000-0000-0000-0000-000000000000")


def test_values_list_rows_match_the_orms(run: Any, prod_alerts: Any) -> None:
    action = applied_prod_alerts_action(run.run)
    Action.objects.filter(pk=action.pk).update(status="queued")
    kind, name = action.kind_id, action.name
    expected = list(in_flight_on(kind, name).values_list("id", "operation", "observed_version"))
    assert expected
    assert [
        (w.id, w.operation, w.observed_version) for w in writes_in_flight(kind, name)
    ] == expected
    assert writes_in_flight(kind, "nothing-here") == []


def _authority_through_the_orm(run_id: Any, kind: str) -> tuple[list[Any], list[Any]]:
    now = timezone.now()
    records = list(
        OwnershipRecord.objects.filter(kind_id=kind, active=True, expires_at__gt=now)
        .filter(Q(run_id=run_id) | Q(exclusive=True, run__status="active", run__expires_at__gt=now))
        .order_by("created_at", "id")
    )
    return [r for r in records if r.run_id == run_id], [r for r in records if r.run_id != run_id]


def test_the_write_set_check_reads_what_the_orm_reads(agent: AgentActor) -> None:
    """Own records, another run's exclusive lease (seen), then that run expired (not seen)."""
    mine = make_active_run(agent.agent)
    other = make_active_run(
        make_agent_with_token("lease-bot").agent,
        [{"resource": "notification-policy/prod-alerts", "operations": ["create"], "lease": True}],
    )
    kind = "notification-policy"
    own, leases = actions._authority_records(mine.run.pk, kind)
    expected_own, expected_leases = _authority_through_the_orm(mine.run.pk, kind)
    assert [r.pk for r in own] == [r.pk for r in expected_own] and own
    assert [r.pk for r in leases] == [r.pk for r in expected_leases]
    assert [r.run_id for r in leases] == [other.run.pk]
    assert _fields(leases[0]) == _fields(expected_leases[0])
    Run.objects.filter(pk=other.run.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert actions._authority_records(mine.run.pk, kind)[1] == []
    assert _authority_through_the_orm(mine.run.pk, kind)[1] == []


def test_a_token_resolves_through_the_compiled_lookups(agent: AgentActor) -> None:
    run = make_active_run(agent.agent)
    principal = tokens.principal_for_token(run.token)
    assert principal is not None and principal.run is not None
    assert principal.run.pk == run.run.pk and principal.agent.name == agent.agent.name
    by_agent = tokens.principal_for_token(agent.token)
    assert by_agent is not None and by_agent.kind == "agent" and by_agent.agent.pk == agent.agent.pk
    assert tokens.principal_for_token(agent.token[:-2] + "xx") is None
    Run.objects.filter(pk=run.run.pk).update(token_prefix="zzzzzzzz")
    assert tokens.principal_for_token(run.token) is None


_TASK = Run._meta.get_field("task")


def test_shapes_it_cannot_run_faithfully_are_refused() -> None:
    prefetching = CompiledQuery(
        lambda: Run.objects.filter(task=Param("task", _TASK)).prefetch_related("ownership")
    )
    with pytest.raises(TypeError, match="prefetch"):
        prefetching.all(task="x")
    constant = CompiledQuery(lambda: Run.objects.filter(task="x"))
    with pytest.raises(TypeError, match="constant"):
        constant.all()
    annotated_values = CompiledQuery(
        lambda: (
            Run.objects.filter(task=Param("task", _TASK))
            .annotate(n=Count("ownership"))
            .values_list("id", "n")
        )
    )
    with pytest.raises(TypeError, match="plain columns"):
        annotated_values.all(task="x")
    missing = CompiledQuery(lambda: Run.objects.filter(task=Param("task", _TASK)))
    with pytest.raises(TypeError, match="no value given"):
        missing.all()


def test_an_action_poll_reads_for_each_token_what_the_orm_reads(run: Any, prod_alerts: Any) -> None:
    """The poll's two reads, compiled once per token scope's shape, against the selector they
    stand for (actions_visible_to): the agent's token, its run's, another live run of the
    same agent (the agent's actions), that run once ended (its own actions only), another
    agent's token (nothing)."""
    from approvals.api.actions import _revision_and_status, _with_body

    action = applied_prod_alerts_action(run.run)
    agent = run.run.agent
    sibling = make_active_run(
        agent, [{"resource": "dns-record/web-1", "operations": ["create"]}]
    ).run
    stranger = make_agent_with_token("other-bot").agent

    def reads(reader: Any) -> bool:
        visible = actions_visible_to(reader).filter(pk=action.pk)
        row = visible.values_list("revision", "status").first()
        assert _revision_and_status(reader, action.pk) == row
        expected, found = with_body_facts(visible).first(), _with_body(reader, action.pk)
        assert (found is None) == (expected is None) == (row is None)
        if expected is not None:
            assert found is not None and _fields(found) == _fields(expected)
            assert _fields(found.run.agent) == _fields(expected.run.agent)
            for name in ("_write_conflict", "_execution", "_undo_requested"):
                assert getattr(found, name) == getattr(expected, name), name
        return row is not None

    assert [reads(reader) for reader in (agent, run.run, sibling, stranger)] == [
        True,
        True,
        True,
        False,
    ]
    Run.objects.filter(pk=sibling.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    sibling.refresh_from_db()
    assert reads(sibling) is False  # ended: its own run's actions only
    assert reads(run.run) is True
    assert _revision_and_status(agent, uuid.uuid4()) is None


# --- CompiledInsert ----------------------------------------------------------------------


def _record(agent: Any, key: str) -> IdempotencyRecord:
    return IdempotencyRecord(
        agent=agent,
        key=key,
        fingerprint="f" * 64,
        method="PUT",
        path="/api/v1/resources/dns-record/app-a",
        status=IdempotencyStatus.IN_FLIGHT,
        expires_at=timezone.now() + timedelta(hours=1),
    )


def _stored(instance: Any, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The row as the database has it, less the columns that differ by construction."""
    row = type(instance).objects.get(pk=instance.pk)
    return {name: value for name, value in _fields(row).items() if name not in skip}


def test_an_insert_writes_the_row_save_writes(run: Any, prod_alerts: Any) -> None:
    model = applied_prod_alerts_action(run.run)
    columns = {
        field.attname: getattr(model, field.attname)
        for field in Action._meta.concrete_fields
        if field.attname not in ("id", "created_at", "updated_at", "idempotency_key")
    }
    saved = Action(**columns, idempotency_key="by-save-1")
    saved.save(force_insert=True)
    inserted = Action(**columns, idempotency_key="by-insert-1")
    with CaptureQueriesContext(connection) as captured:
        assert CompiledInsert(Action).insert(inserted) is True
    assert len(captured.captured_queries) == 1
    assert captured.captured_queries[0]["sql"].startswith('INSERT INTO "approvals_action"')
    assert inserted.pk is not None and inserted.pk != saved.pk
    assert not inserted._state.adding and inserted._state.db == "default"
    # The same columns stored, auto_now(_add) stamped, a UUID given by the field's default.
    skip = ("id", "created_at", "updated_at", "idempotency_key")
    assert _stored(inserted, skip=skip) == _stored(saved, skip=skip)
    stored = Action.objects.get(pk=inserted.pk)
    assert stored.created_at == inserted.created_at and stored.updated_at is not None


def test_an_auto_id_comes_back_and_a_held_key_is_skipped_without_an_error(
    agent: AgentActor,
) -> None:
    claim = CompiledInsert(IdempotencyRecord, skip_conflicts=True)
    first = _record(agent.agent, "claim-key-1")
    assert claim.insert(first) is True
    assert isinstance(first.pk, int)
    assert _stored(first) == _fields(first)
    with transaction.atomic():
        second = _record(agent.agent, "claim-key-1")
        assert claim.insert(second) is False
        assert second.pk is None and second._state.adding
        # No error was raised in the transaction: it goes on (no savepoint needed).
        assert IdempotencyRecord.objects.filter(key="claim-key-1").count() == 1
    # Without skip_conflicts a held key is the IntegrityError save() raises.
    with pytest.raises(IntegrityError), transaction.atomic():
        CompiledInsert(IdempotencyRecord).insert(_record(agent.agent, "claim-key-1"))


def test_the_save_signals_are_sent_as_save_sends_them(agent: AgentActor) -> None:
    heard: list[tuple[str, bool | None]] = []

    def pre(sender: Any, instance: Any, raw: bool, **kwargs: Any) -> None:
        heard.append(("pre", instance.pk is None))

    def post(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
        heard.append(("post", created))

    pre_save.connect(pre, sender=IdempotencyRecord)
    post_save.connect(post, sender=IdempotencyRecord)
    try:
        CompiledInsert(IdempotencyRecord).insert(_record(agent.agent, "signal-key-1"))
    finally:
        pre_save.disconnect(pre, sender=IdempotencyRecord)
        post_save.disconnect(post, sender=IdempotencyRecord)
    assert heard == [("pre", True), ("post", True)]


def test_inserts_it_cannot_make_faithfully_are_refused(agent: AgentActor) -> None:
    with pytest.raises(TypeError, match="got Run"):
        CompiledInsert(IdempotencyRecord).insert(Run())  # type: ignore[arg-type]
    numbered = _record(agent.agent, "numbered-key-1")
    numbered.pk = 12345
    with pytest.raises(TypeError, match="no id given"):
        CompiledInsert(IdempotencyRecord).insert(numbered)
    expression = _record(agent.agent, "expression-key-1")
    expression.path = Value("/x")  # type: ignore[assignment]
    with pytest.raises(TypeError, match="expressions"):
        CompiledInsert(IdempotencyRecord).insert(expression)
    assert not IdempotencyRecord.objects.filter(agent=agent.agent).exists()


def _versions(resource: Resource, count: int, start: int) -> list[ResourceVersion]:
    return [
        ResourceVersion(
            resource=resource,
            version=start + n,
            document={"ttl": n, "tags": ["a", n]},
            deleted=n % 2 == 1,
            operation="update",
            fence=100 + n,
        )
        for n in range(count)
    ]


def test_many_rows_are_the_rows_bulk_create_writes_in_order_with_their_ids() -> None:
    resource = make_resource("dns-record/app-many", {"ttl": 1}, version=1)
    # Over one chunk: two statements, the rows in the caller's order either way.
    count = CompiledInsert.CHUNK + 3
    by_bulk = ResourceVersion.objects.bulk_create(_versions(resource, count, 1000))
    with CaptureQueriesContext(connection) as captured:
        inserted = CompiledInsert(ResourceVersion).insert_many(_versions(resource, count, 2000))
    assert len(captured.captured_queries) == 2
    assert [row.version for row in inserted] == list(range(2000, 2000 + count))
    ids = [row.pk for row in inserted]
    assert all(isinstance(pk, int) for pk in ids) and ids == sorted(ids)
    assert all(not row._state.adding and row._state.db == "default" for row in inserted)
    skip = ("id", "version", "created_at")
    for bulk, compiled in zip(by_bulk, inserted, strict=True):
        assert _stored(compiled, skip=skip) == _stored(bulk, skip=skip)
        assert _stored(compiled)["version"] == compiled.version
    assert CompiledInsert(ResourceVersion).insert_many([]) == []


def test_many_rows_fail_whole_and_skipping_conflicts_is_one_row_at_a_time(
    agent: AgentActor,
) -> None:
    resource = make_resource("dns-record/app-whole", {"ttl": 1}, version=1)
    rows = _versions(resource, 3, 10)
    rows[2].operation = None  # type: ignore[assignment]  # NOT NULL: the statement fails whole
    with pytest.raises(IntegrityError), transaction.atomic():
        CompiledInsert(ResourceVersion).insert_many(rows)
    assert not ResourceVersion.objects.filter(resource=resource, version__gte=10).exists()
    with pytest.raises(TypeError, match="insert each row"):
        CompiledInsert(IdempotencyRecord, skip_conflicts=True).insert_many(
            [_record(agent.agent, "many-key-1")]
        )


# --- CompiledUpdate ----------------------------------------------------------------------


def test_an_update_changes_what_the_orms_update_changes(
    agent: AgentActor, run: Any, prod_alerts: Any
) -> None:
    action = applied_prod_alerts_action(run.run)
    claim = CompiledInsert(IdempotencyRecord, skip_conflicts=True)
    by_orm, compiled = _record(agent.agent, "update-key-1"), _record(agent.agent, "update-key-2")
    assert claim.insert(by_orm) and claim.insert(compiled)
    columns = {
        "status": IdempotencyStatus.DONE,
        "response_status": 202,
        "response_headers": {"Content-Type": "application/json", "ETag": '"x"'},
        "response_body": b'{"id": 1}',
        "action_id": action.pk,
    }
    in_flight = {"status": IdempotencyStatus.IN_FLIGHT}
    update = CompiledUpdate(IdempotencyRecord, columns=tuple(columns), where=("id", "status"))
    assert IdempotencyRecord.objects.filter(pk=by_orm.pk, **in_flight).update(**columns) == 1
    with CaptureQueriesContext(connection) as captured:
        assert update.update(columns=columns, where={"id": compiled.pk, **in_flight}) == 1
    assert len(captured.captured_queries) == 1
    skip = ("id", "key", "created_at", "expires_at")
    assert _stored(compiled, skip=skip) == _stored(by_orm, skip=skip)
    assert bytes(IdempotencyRecord.objects.get(pk=compiled.pk).response_body) == b'{"id": 1}'
    # The condition holds no more: nothing changes.
    assert update.update(columns=columns, where={"id": compiled.pk, **in_flight}) == 0


def test_updates_it_cannot_make_faithfully_are_refused(agent: AgentActor) -> None:
    update = CompiledUpdate(IdempotencyRecord, columns=("status",), where=("id",))
    with pytest.raises(TypeError, match="compiled for"):
        update.update(columns={"path": "/x"}, where={"id": 1})
    with pytest.raises(TypeError, match="not None"):
        update.update(columns={"status": "done"}, where={"id": None})
    with pytest.raises(TypeError, match="expressions"):
        update.update(columns={"status": Value("done")}, where={"id": 1})
    with pytest.raises(TypeError, match="own columns"):
        CompiledUpdate(Run, columns=("ownership",), where=("id",))


def test_a_locking_read_says_for_update_and_is_refused_outside_a_transaction(
    run: Any, prod_alerts: Any
) -> None:
    action = applied_prod_alerts_action(run.run)
    with CaptureQueriesContext(connection) as captured:
        assert row_locks.action_locked(action.pk, related=True).run.agent_id == run.run.agent_id
        assert row_locks.action_locked(action.pk).pk == action.pk
        assert row_locks.run_of_action(action.pk) == run.run.pk
        assert row_locks.mirror_locked("notification-policy", "prod-alerts") is not None
        assert row_locks.mirror_locked("notification-policy", "none-such") is None
    sql = [q["sql"] for q in captured.captured_queries]
    assert sql[0].endswith('FOR UPDATE OF "approvals_action"'), sql[0]
    assert sql[1].endswith('FOR UPDATE OF "approvals_action"'), sql[1]
    assert "FOR UPDATE" not in sql[2]
    assert sql[3].endswith("FOR UPDATE"), sql[3]
    with pytest.raises(Action.DoesNotExist):
        row_locks.action_locked(uuid.uuid4())


@pytest.mark.django_db(transaction=True)
def test_a_compiled_locking_read_outside_a_transaction_is_refused_as_the_orms_is() -> None:
    with transaction.atomic():  # compiled inside one, as its callers run it
        assert row_locks.operation_locked(0) is None
    assert connection.get_autocommit()
    with pytest.raises(TransactionManagementError, match="outside of a transaction"):
        row_locks.operation_locked(0)
