"""One verification of the audit chain everywhere: the badge and the API walk only
what was appended since a checkpoint every process shares; whole walks
(`audit_verify`, the periodic job) find a change to events already verified."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rq.cron import CronScheduler

from audit import verify
from audit.chain import GENESIS_HASH
from audit.jobs import audit_verify_job
from audit.linker import audit_link
from audit.models import AuditEvent
from audit.services import Actor, audit_append, audit_chain_status, audit_chain_verify
from tests.conftest import ROOT, subprocess_env
from tests.fixtures.audit import forget_verification
from tests.fixtures.console import People, client_for


@pytest.fixture(autouse=True)
def _no_checkpoint() -> Iterator[None]:
    forget_verification()
    yield
    forget_verification()


def _append(count: int) -> list[AuditEvent]:
    """`count` events, appended and linked (audit/linker.py): as stored."""
    seqs = [
        audit_append(event_type="test.event", actor=Actor.system("tests"), details={"n": n}).seq
        for n in range(count)
    ]
    audit_link()
    return list(AuditEvent.objects.filter(seq__in=seqs).order_by("seq"))


def _sql(statement: str, params: list[Any] | None = None) -> None:
    # The test connection has airlock.audit_maintenance on (conftest): tampering is possible.
    with connection.cursor() as cursor:
        cursor.execute(statement, params or [])


def _tamper(seq: int) -> None:
    _sql("UPDATE audit_auditevent SET details = '{\"forged\": true}' WHERE seq = %s", [seq])


@pytest.mark.django_db
def test_after_n_new_events_the_status_walks_only_those_n() -> None:
    _append(7)
    cold = audit_chain_status()
    assert cold.ok and cold.events == 7 and cold.walked == 7 and cold.full_walk_at is not None
    unchanged = audit_chain_status()
    assert unchanged.cached and unchanged.walked == 0 and unchanged.events == 7
    _append(5)
    moved = audit_chain_status()
    assert moved.ok and not moved.cached and moved.events == 12 and moved.walked == 5
    assert moved.head_hash == verify.verify_chain().head_hash
    assert moved.full_walk_at == cold.full_walk_at  # no whole walk since the first
    forget_verification()  # Redis lost: one walk from the start
    assert audit_chain_status().walked == 12


@pytest.mark.django_db
def test_the_badge_after_new_events_reads_only_the_new_rows(people: People) -> None:
    _append(4)
    client = client_for(people.auditor)
    assert (
        "Chain verified</span>: linked up to seq 4" in client.get("/audit/verify/").content.decode()
    )
    _append(3)
    with CaptureQueriesContext(connection) as moved:
        html = client.get("/audit/verify/").content.decode()
    assert "Chain verified</span>: linked up to seq 7" in html
    # The walk, and the linker's look past the head: only rows after the checkpoint.
    reads = [q["sql"] for q in moved.captured_queries if 'FROM "audit_auditevent"' in q["sql"]]
    walks = [sql for sql in reads if '"seq" <= 7' in sql and "hash" in sql]
    assert len(walks) == 1 and '"seq" > 4' in walks[0], reads
    assert all('"seq" > 4' in sql or '"seq" > 7' in sql for sql in reads), reads


@pytest.mark.django_db
@pytest.mark.parametrize("whole_walk", ["command", "periodic job"])
def test_a_tamper_in_the_verified_prefix_is_found_by_the_whole_walks(
    people: People, whole_walk: str
) -> None:
    _append(10)
    assert audit_chain_status().ok
    _tamper(3)
    _append(2)
    tail = audit_chain_status()
    assert tail.ok and tail.walked == 2  # by design: the badge walks only the new tail
    if whole_walk == "command":
        with pytest.raises(CommandError, match="first bad seq 3"):
            call_command("audit_verify", stdout=open("/dev/null", "w"))  # noqa: SIM115
    else:
        assert audit_verify_job() == {"ok": False, "events": 2, "first_bad_seq": 3}
    # Every process now answers with the break, without walking again.
    known = audit_chain_status()
    assert not known.ok and known.first_bad_seq == 3 and known.walked == 0
    _append(1)
    assert audit_chain_status().first_bad_seq == 3  # a new tail does not hide it
    html = client_for(people.auditor).get("/audit/verify/").content.decode()
    assert "Chain broken</span> at seq 3" in html


def test_the_cron_schedules_the_whole_walk(redis_client: Any) -> None:
    scheduler = CronScheduler(connection=redis_client)
    scheduler.load_config_from_file("approvals.cron")
    scheduled = {job.func for job in scheduler.get_jobs()}
    assert audit_verify_job in scheduled


@pytest.mark.django_db
def test_a_whole_walk_that_finds_the_chain_whole_again_clears_the_break() -> None:
    _append(5)
    _tamper(2)
    assert not audit_chain_verify().ok
    assert audit_chain_status().first_bad_seq == 2
    _sql("UPDATE audit_auditevent SET details = '{\"n\": 1}' WHERE seq = 2")  # restored
    assert audit_chain_verify().ok
    assert audit_chain_status().ok


@pytest.mark.django_db
def test_a_checkpoint_of_another_chain_costs_a_walk_from_the_start_not_a_false_break() -> None:
    _append(5)
    assert audit_chain_status().ok  # the checkpoint: #5 of this chain
    # Another database behind the same Redis (or one restored from a backup).
    _sql("DELETE FROM audit_auditevent")
    _sql("UPDATE audit_audithead SET seq = 0, hash = %s", [GENESIS_HASH])
    _sql("SELECT setval('audit_auditevent_seq', 1, false)")  # its own numbers
    _append(6)
    status = audit_chain_status()
    assert status.ok and status.events == 6 and status.walked == 6  # the whole walk
    _append(2)
    assert audit_chain_status().walked == 2


@pytest.mark.django_db
@pytest.mark.parametrize("walk", ["whole", "tail"])
def test_events_appended_while_a_walk_runs_are_left_to_the_next_walk(
    monkeypatch: pytest.MonkeyPatch, walk: str
) -> None:
    _append(5)
    if walk == "tail":
        assert audit_chain_status().ok
        _append(2)
    read_head = verify.audit_head

    def head_then_appends() -> tuple[int, str]:
        head = read_head()
        monkeypatch.setattr(verify, "audit_head", read_head)
        _append(3)  # committed as far as the walk's connection can tell
        return head

    # Forced: three appends land after the walk read the head, before it reads rows.
    monkeypatch.setattr(verify, "audit_head", head_then_appends)
    status = audit_chain_verify() if walk == "whole" else audit_chain_status()
    before = 5 if walk == "whole" else 7
    assert status.ok and status.events == before, status
    after = audit_chain_status()
    assert after.ok and after.events == before + 3 and after.walked == 3


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_two_processes_share_one_checkpoint() -> None:
    _append(6)
    assert audit_chain_status().walked == 6
    other = _status_in_another_process()
    assert other == {"ok": True, "events": 6, "walked": 0, "cached": True}
    _append(4)
    assert _status_in_another_process() == {"ok": True, "events": 10, "walked": 4, "cached": False}
    mine = audit_chain_status()  # the other process moved the checkpoint
    assert mine.cached and mine.events == 10 and mine.walked == 0


_STATUS_SCRIPT = """
import json, django
django.setup()
from audit.services import audit_chain_status
status = audit_chain_status()
print(json.dumps({"ok": status.ok, "events": status.events, "walked": status.walked,
                  "cached": status.cached}))
"""


def _status_in_another_process() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _STATUS_SCRIPT],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer
