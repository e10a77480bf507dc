"""The backup and restore drill of docs/operations.md, with the real tools: `pg_dump` of a
database that has applied writes and an audit chain, `pg_restore` into a fresh database, then
what the page says to run — `migrate`, `audit_verify` — and a write that was queued when the
backup was taken applies on the restored database, above every fence the rows carry."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from approvals.services.execution import action_execute
from engine.core.fence import FENCE_SEQUENCE, fence_floor
from tests.conftest import ROOT, subprocess_env, test_database_url
from tests.deployload import script_json

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def run(*command: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        list(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, f"{command}: {done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture
def fresh_database() -> Any:
    name = f"airlock_restore_{uuid.uuid4().hex[:8]}"
    admin = test_database_url().rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield test_database_url().rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_restored_dump_verifies_and_takes_the_next_write(
    engine_world: Any, engine_redis: Any, fresh_database: str, tmp_path: Path
) -> None:
    applied = engine_world.proposed_create("before", {"ip": "10.0.0.1"})
    assert action_execute(action_id=applied.pk) == "applied"
    queued = engine_world.proposed_create("after", {"ip": "10.0.0.2"})
    floor = fence_floor()
    assert floor > 0

    dump = tmp_path / "airlock.dump"
    run("pg_dump", "--format=custom", f"--file={dump}", f"--dbname={test_database_url()}")
    run("pg_restore", "--no-owner", f"--dbname={fresh_database}", str(dump))
    # A sequence restored older than the rows (a backup of the rows taken after the
    # sequence's): the case the fence floor exists for.
    with psycopg.connect(fresh_database, autocommit=True) as conn:
        conn.execute("SELECT setval(%s, 1, true)", [FENCE_SEQUENCE])

    env = subprocess_env(DATABASE_URL=fresh_database, REDIS_URL=engine_redis.url)
    run(sys.executable, "manage.py", "migrate", "--noinput", env=env)
    verified = run(sys.executable, "manage.py", "audit_verify", env=env)
    assert "audit chain ok" in verified, verified

    result = script_json(
        "import django, json; django.setup()\n"
        "from approvals.services.execution import action_execute\n"
        "from ownership.models import Resource\n"
        f"outcome = action_execute(action_id='{queued.pk}')\n"
        "r = Resource.objects.get(kind_id='dns-record', name='after')\n"
        "print(json.dumps({'outcome': outcome, 'fence': r.last_fence}))",
        environment=env,
    )
    assert result["outcome"] == "applied"
    assert result["fence"] > floor
    # The test database itself is untouched by the drill.
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM ownership_resource WHERE name = 'after'")
        assert cursor.fetchone() == (0,)
