"""bench/targets.py runs on a tiny number of rounds and reports every ratio. It measures;
it never asserts speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_targets_bench_reports_each_adapter_against_its_bare_write() -> None:
    server = urlsplit(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/airlock"))
    database = f"{server.path.lstrip('/') or 'airlock'}_tbench"
    admin_url = urlunsplit(server._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
        )
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    env = {
        **os.environ,
        "BENCH_TARGETS_DATABASE_URL": urlunsplit(server._replace(path=f"/{database}")),
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bench.targets", "--rounds", "5", "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
            )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)
    assert figures["rounds"] == 5 and "not end to end" in figures["what"]
    pg = figures["postgres"]
    for key in ("adapter_ms", "bare_open_connection_ms", "bare_connect_each_time_ms"):
        assert pg[key] > 0
    assert pg["ratio_vs_open_connection"] > 0 and pg["ratio_vs_connect_each_time"] > 0
    assert figures["http_etag"]["bare_put_ms"] > 0 and figures["http_etag"]["ratio"] > 0
    assert figures["git"]["bare_commit_ms"] > 0 and figures["git"]["ratio"] > 0
