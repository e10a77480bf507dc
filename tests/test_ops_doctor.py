"""`manage.py doctor` and `/readyz` say what a deployment lacks, against real parts: a real RQ
worker and a real `rqcron` process on a private Redis, the test database's own fence sequence
and migrations."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client

from console.management.commands.doctor import diagnose
from engine.core.fence import FENCE_SEQUENCE, ensure_fence_floor, fence_floor
from ownership.models import Resource
from tests.conftest import ROOT, subprocess_env
from tests.fixtures.core import make_kind
from tests.fixtures.engine import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cron(engine_redis: Any, tmp_path: Any) -> Iterator[subprocess.Popen[bytes]]:
    """The Procfile's cron line on the private Redis."""
    log = (tmp_path / "cron.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "rqcron", "approvals.cron"],
        env=subprocess_env(REDIS_URL=engine_redis.url),
        cwd=str(ROOT),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield process
    process.terminate()
    process.wait(timeout=10)
    log.close()


def problems() -> list[str]:
    return [f.text for f in diagnose() if f.kind == "problem"]


def test_readyz_answers_ready_once_a_worker_listens_and_the_cron_beats(
    engine_redis: Any, rq_worker: Any, cron: Any
) -> None:
    rq_worker()
    wait_for(lambda: Client().get("/readyz").status_code == 200, timeout=30)
    ready = Client().get("/readyz").json()
    assert ready["workers_listening"] >= 1 and ready["cron_schedulers"] >= 1
    assert ready["database"] == ready["redis"] == ready["migrations"] == "ok"
    assert not [p for p in problems() if p.startswith(("workers", "cron"))]


def test_readyz_and_doctor_without_any_worker_or_cron(engine_redis: Any) -> None:
    answer = Client().get("/readyz")
    assert answer.status_code == 503 and answer["Retry-After"] == "5"
    body = answer.json()
    assert body["workers"].startswith("no worker") and body["cron"].startswith("no cron")
    found = problems()
    assert any(p.startswith("workers:") for p in found)
    assert any(p.startswith("cron:") for p in found)
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_code:
        call_command("doctor", stdout=out)
    assert exit_code.value.code == 1
    assert "fix: start the Procfile's `worker` line" in out.getvalue()
    call_command("doctor", "--warn-only", stdout=io.StringIO())  # no exit


def test_doctor_finds_a_fence_source_behind_the_rows_and_migrate_fixes_it(
    engine_redis: Any,
) -> None:
    kind = make_kind("doctor-kind")
    Resource.objects.create(kind=kind, name="r", last_fence=5000, owner_group="g")
    with connection.cursor() as cursor:  # a restore of an older sequence
        cursor.execute(f"SELECT setval('{FENCE_SEQUENCE}', 10, true)")
    assert fence_floor() == 5000
    assert any("below the highest stored fence (5000)" in p for p in problems())
    ensure_fence_floor()  # what `migrate` runs after a restore
    assert not any("fence" in p for p in problems())


def test_doctor_finds_migrations_not_applied(engine_redis: Any) -> None:
    call_command("migrate", "approvals", "0007", verbosity=0)
    try:
        assert any(p.startswith("migrations") for p in problems())
        body = Client().get("/readyz").json()
        assert re.fullmatch(r"[1-9]\d* not applied", body["migrations"]), body
    finally:
        call_command("migrate", verbosity=0)
    assert not any(p.startswith("migrations") for p in problems())


def test_doctor_asks_for_a_notify_worker_until_one_listens_on_the_notifications_queue(
    engine_redis: Any, rq_worker: Any
) -> None:
    """The engine's worker does not serve deliveries (their own queue): doctor says so, and
    stops saying so once the Procfile's `notify` line runs."""
    rq_worker()
    wait_for(lambda: not [p for p in problems() if p.startswith("workers")], timeout=30)
    assert any(p.startswith("notify workers: no worker") for p in problems())
    rq_worker(line="notify")
    wait_for(lambda: not [p for p in problems() if p.startswith("notify")], timeout=30)
