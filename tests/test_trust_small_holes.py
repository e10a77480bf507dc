"""Issue 9, item 10: the fence floor at start and on migrate, /metrics without free
text or table scans, the audit head that only moves forward, and login lockouts
per (username, address) pair and per address behind the documented proxy header."""

from __future__ import annotations

import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from approvals.models import Action
from approvals.services.execution import action_execute
from audit.linker import audit_link
from audit.models import AuditEvent, AuditHead
from audit.services import Actor, audit_append
from audit.verify import verify_chain
from console import ops
from engine.core.fence import FENCE_SEQUENCE, current_fence, forget_fence_floor_check
from ownership.models import Resource
from tests.conftest import ROOT, subprocess_env
from tests.fixtures.audit import assert_an_ordinary_role_is_refused
from tests.fixtures.console import PASSWORD, People
from tests.fixtures.engine import wait_for
from tests.test_settings_deploy import PRODUCTION, check_deploy

# -- (a) the fence floor ---------------------------------------------------------------


@dataclass
class RestoredSequence:
    """What a restore leaves: cfg/restored (version 1) carries a fence, `floor`, that the
    (older) fence sequence has not reached."""

    world: Any
    kind: Any
    floor: int

    def write(self) -> Action:
        """The next write of cfg/restored, queued."""
        action: Action = self.world.propose(
            self.kind, "restored", payload={"v": 2}, observed_version=1
        )
        return action


@pytest.fixture
def restored(engine_world: Any) -> RestoredSequence:
    kind = engine_world.kind("cfg", update="recompute_field")
    resource = engine_world.resource(kind, "restored", {"v": 1})
    floor = current_fence() + 10_000
    Resource.objects.filter(pk=resource.pk).update(last_fence=floor)
    with connection.cursor() as cursor:
        cursor.execute("SELECT setval(%s, 1, true)", [FENCE_SEQUENCE])
    assert current_fence() < floor
    return RestoredSequence(engine_world, kind, floor)


@pytest.mark.django_db
def test_the_first_fence_of_a_process_lifts_a_sequence_restored_behind_the_rows(
    restored: RestoredSequence, engine_redis: Any
) -> None:
    forget_fence_floor_check()  # what a freshly started web or worker process has

    assert action_execute(action_id=restored.write().pk) == "applied"

    resource = Resource.objects.get(kind=restored.kind, name="restored")
    assert resource.version == 2 and resource.last_fence > restored.floor


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_started_on_a_restored_database_applies_the_next_write(
    restored: RestoredSequence, rq_worker: Any
) -> None:
    worker = rq_worker()

    action = restored.write()
    wait_for(lambda: Action.objects.get(pk=action.pk).status in ("applied", "failed"))

    assert Action.objects.get(pk=action.pk).status == "applied", worker.output()
    assert Resource.objects.get(kind=restored.kind, name="restored").last_fence > restored.floor


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_migrate_lifts_a_sequence_restored_behind_the_rows(
    restored: RestoredSequence, engine_redis: Any
) -> None:
    migrate = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert migrate.returncode == 0, migrate.stdout + migrate.stderr
    assert current_fence() >= restored.floor
    assert action_execute(action_id=restored.write().pk) == "applied"


# -- (b) /metrics -----------------------------------------------------------------------


@pytest.mark.django_db
def test_metrics_carry_no_kill_switch_reason_and_scrape_only_live_rows(
    engine_world: Any, engine_redis: Any
) -> None:
    action = engine_world.proposed_update("a", {"v": 1}, {"v": 2})
    secret_reason = "Incident 7: bob's laptop was stolen, call +1 555 0100"
    Action.objects.filter(pk=action.pk).update(status="paused", paused_reason=secret_reason)
    ops.forget_history_cache()
    client = Client()

    first = client.get("/metrics").content.decode()
    assert "bob" not in first and "Incident" not in first and "reason=" not in first
    assert "airlock_paused_actions 1\n" in first
    assert 'airlock_actions{status="paused"} 1\n' in first

    # Within the cache window a scrape runs only the live, status-filtered counts (actions
    # and conflicts in flight, pending approvals, unknown operations, paused actions by
    # kind), reads the engaged kill switches and how long the audit linking is behind
    # (events past the head only).
    with CaptureQueriesContext(connection) as queries:
        second = client.get("/metrics").content.decode()
    sql = [q["sql"] for q in queries.captured_queries]
    assert len(sql) == 7, sql
    assert all(
        '"status" IN' in s or '"status" =' in s or '"engaged"' in s or "e.seq > h.seq" in s
        for s in sql
    ), sql
    assert "airlock_approval_latency_seconds_count" in second


def test_check_deploy_warns_when_metrics_token_is_unset(tmp_path: Path) -> None:
    env = subprocess_env(**PRODUCTION, SECRET_KEY=secrets.token_urlsafe(60))
    env.pop("METRICS_TOKEN")
    env["AIRLOCK_DATA_DIR"] = str(tmp_path)
    result = check_deploy(env)
    assert result.returncode != 0
    assert "airlock.W010" in result.stdout + result.stderr
    assert "METRICS_TOKEN" in result.stdout + result.stderr


# -- (c) the audit head --------------------------------------------------------------------


def _outside_maintenance(statement: str, params: list[Any] | None = None) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL airlock.audit_maintenance = 'off'")
        cursor.execute(statement, params or [])


@pytest.mark.django_db
@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE audit_audithead SET seq = seq - 1",
        "UPDATE audit_audithead SET seq = 0, hash = %s",
        "UPDATE audit_audithead SET hash = %s",
        "UPDATE audit_audithead SET id = 2",
        "DELETE FROM audit_audithead",
        "TRUNCATE audit_audithead",
    ],
)
def test_the_audit_head_refuses_to_move_backwards_or_disappear(statement: str) -> None:
    for index in range(3):
        audit_append(event_type="test.event", actor=Actor.system(), details={"i": index})
    audit_link()
    before = AuditHead.objects.values_list("id", "seq", "hash").get()
    params = ["0" * 64] if "%s" in statement else []

    with pytest.raises(DatabaseError, match="only moves forward"):
        _outside_maintenance(statement, params)

    assert AuditHead.objects.values_list("id", "seq", "hash").get() == before
    assert verify_chain().ok


@pytest.mark.django_db
def test_appends_still_move_the_head_forward_outside_maintenance() -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL airlock.audit_maintenance = 'off'")
        for index in range(3):
            audit_append(event_type="test.event", actor=Actor.system(), details={"i": index})
        audit_link()  # the linker's UPDATE of the events and the head pass the triggers
    head = AuditHead.objects.get()
    assert head.seq == 3 and head.hash == AuditEvent.objects.get(seq=3).hash
    assert verify_chain().ok


@pytest.mark.django_db
def test_an_ordinary_role_cannot_rewind_the_head_even_with_the_maintenance_setting() -> None:
    audit_append(event_type="test.event", actor=Actor.system(), details={})
    audit_link()
    assert_an_ordinary_role_is_refused(
        "UPDATE audit_audithead SET seq = 0", table="audit_audithead", match="only moves forward"
    )
    assert AuditHead.objects.get().seq == 1


# -- (d) login lockout ----------------------------------------------------------------------


def _sign_in(client: Client, username: str, password: str, **environ: str) -> Any:
    return client.post("/login/", {"username": username, "password": password}, **environ)


@pytest.mark.django_db
def test_a_username_guessed_from_many_addresses_is_not_locked_out(people: People) -> None:
    # Issue 38, item 7: a username alone is only ever delayed a few seconds, never locked
    # (tests/test_trust_login_throttle.py has the delays).
    for index in range(5):
        _sign_in(Client(), "olivia", "wrong", REMOTE_ADDR=f"198.51.100.{index + 1}")

    signed_in = _sign_in(Client(), "olivia", PASSWORD, REMOTE_ADDR="198.51.100.99")

    assert signed_in.status_code == 302
    # Another person signs in from any of those addresses as usual.
    assert _sign_in(Client(), "pat", PASSWORD, REMOTE_ADDR="198.51.100.98").status_code == 302


@pytest.mark.django_db
def test_an_address_trying_many_usernames_is_locked_out(people: People) -> None:
    for name in ("ada", "rita", "aud", "oscar", "nobody"):
        _sign_in(Client(), name, "wrong", REMOTE_ADDR="203.0.113.7")

    locked = _sign_in(Client(), "olivia", PASSWORD, REMOTE_ADDR="203.0.113.7")

    assert locked.status_code == 429
    assert _sign_in(Client(), "olivia", PASSWORD, REMOTE_ADDR="203.0.113.8").status_code == 302


@pytest.mark.django_db
def test_a_sprayer_signing_into_their_own_account_between_guesses_stays_locked(
    people: People,
) -> None:
    guesses = iter(("ada", "rita", "aud", "nobody", "someone"))
    for attempt in range(5):
        _sign_in(Client(), next(guesses), "wrong", REMOTE_ADDR="203.0.113.9")
        if attempt < 3:  # their own account, before the limit is reached
            assert (
                _sign_in(Client(), "oscar", PASSWORD, REMOTE_ADDR="203.0.113.9").status_code == 302
            )

    assert _sign_in(Client(), "olivia", PASSWORD, REMOTE_ADDR="203.0.113.9").status_code == 429


@pytest.mark.django_db
def test_behind_the_documented_proxy_each_client_is_counted_by_its_own_address(
    people: People, settings: Any
) -> None:
    settings.AIRLOCK_PROXY_COUNT = 1
    proxy = {"REMOTE_ADDR": "10.0.0.2"}
    for name in ("ada", "rita", "aud", "oscar", "nobody"):
        # The client forges a new leftmost entry each time; the proxy appends the truth.
        _sign_in(
            Client(),
            name,
            "wrong",
            HTTP_X_FORWARDED_FOR=f"192.0.2.{len(name)}, 203.0.113.50",
            **proxy,
        )

    sprayer = _sign_in(
        Client(), "olivia", PASSWORD, HTTP_X_FORWARDED_FOR="192.0.2.200, 203.0.113.50", **proxy
    )
    neighbour = _sign_in(Client(), "olivia", PASSWORD, HTTP_X_FORWARDED_FOR="203.0.113.51", **proxy)

    assert sprayer.status_code == 429
    assert neighbour.status_code == 302  # same proxy, another client: not locked out


@pytest.mark.django_db
def test_without_a_declared_proxy_a_forwarding_header_is_ignored(people: People) -> None:
    for index, name in enumerate(("ada", "rita", "aud", "oscar", "nobody")):
        _sign_in(
            Client(),
            name,
            "wrong",
            REMOTE_ADDR="203.0.113.60",
            HTTP_X_FORWARDED_FOR=f"192.0.2.{index}",
        )

    locked = _sign_in(
        Client(), "olivia", PASSWORD, REMOTE_ADDR="203.0.113.60", HTTP_X_FORWARDED_FOR="192.0.2.99"
    )
    assert locked.status_code == 429


def test_the_proxy_settings_are_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("AIRLOCK_PROXY_COUNT", "AIRLOCK_CLIENT_IP_HEADER", "METRICS_TOKEN"):
        assert f"`{name}`" in readme
