"""What one approved write costs end to end on each target adapter, against the bare target
operation, in the same run (issue 39):

    python -m bench.targets_e2e [--rounds N]

End to end here is everything Airlock does for one write, in this process, one write at a
time: the agent's `PUT /api/v1/resources/{kind}/{name}` with `If-Match` (authentication,
write set, the proposal's statements and audit, the job enqueued on a private Redis), then
the job's own work as the worker runs it (`action_execute`: the lock, the fence, the
adapter's conditional write, the operation record, the mirror and the audit). Not in it: the
queue hop to a worker process (its latency is the drain's figure in `make bench`) and the
agent's read before writing (each write starts from the token the previous one left).

The bare operations are bench/targets.py's: one conditional `UPDATE` on an open connection
(and connect + UPDATE + close, what the adapter does per call), one `PUT` with `If-Match`
to WsgiDAV, one single-file git commit + `update-ref` CAS. Rounds alternate between the two
sides; the figures are medians and their ratio.

Database: BENCH_DATABASE_URL (dropped and re-created, as by bench.run); the postgres
target's table lives there too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from bench.in_process import web_process_django
from bench.stack import Stack
from bench.targets import alternate, git_plumbing_commit, put_if_match, wsgidav_server

ENV = "BENCH_E2E_TARGET_DSN"
TABLE = "bench_e2e_accounts"


@contextmanager
def _postgres_target(dsn: str) -> Iterator[dict[str, Any]]:
    ident = sql.Identifier(TABLE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (name text PRIMARY KEY, doc jsonb, version bigint, fence bigint)"
            ).format(ident)
        )
        for name in ("e2e", "bare"):
            conn.execute(
                sql.SQL("INSERT INTO {} VALUES (%s, %s, 1, NULL)").format(ident),
                [name, Jsonb({"n": 0})],
            )
    os.environ[ENV] = dsn
    try:
        yield {
            "target": "postgres",
            "target_settings": {
                "credentials_env": ENV,
                "table": TABLE,
                "key_column": "name",
                "document_column": "doc",
                "version_column": "version",
                "fence_column": "fence",
            },
        }
    finally:
        os.environ.pop(ENV, None)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))


def _bare_update(dsn: str) -> Callable[[int], None]:
    """One conditional UPDATE per call on a connection held open (the cheapest bare write)."""
    held = psycopg.connect(dsn, autocommit=True)
    version, fence = ["1"], [10]
    update = sql.SQL(
        "UPDATE {} SET doc = %s, version = version + 1, fence = %s "
        "WHERE name = 'bare' AND version::text = %s AND (fence IS NULL OR fence < %s) "
        "RETURNING version::text"
    ).format(sql.Identifier(TABLE))

    def step(i: int) -> None:
        fence[0] += 1  # each call's own, rising: the warm-up's call and the rounds' alike
        row = held.execute(update, [Jsonb({"n": i}), fence[0], version[0], fence[0]]).fetchone()
        assert row is not None
        version[0] = row[0]

    return step


class _Writer:
    """The agent's side: a PUT through Django (the API's whole stack, in this process) with
    the token the last write left, then the job's work as the worker does it."""

    def __init__(self, kind: str, name: str, token: str) -> None:
        # reason: Django is set up by web_process_django before this is built
        from django.test import Client

        self.client = Client(HTTP_HOST="127.0.0.1", HTTP_AUTHORIZATION=f"Bearer {token}")
        self.path = f"/api/v1/resources/{kind}/{name}"
        read = self.client.get(self.path)
        if read.status_code != 200:
            raise RuntimeError(f"{self.path}: read answered {read.status_code}")
        self.etag = read["ETag"]

    def step(self, i: int) -> None:
        # reason: Django is set up by web_process_django before this runs
        from approvals.models import Operation
        from approvals.services.execution import action_execute

        answer = self.client.put(
            self.path,
            data=json.dumps({"n": i, "pad": "x" * (i % 7)}),
            content_type="application/json",
            HTTP_IF_MATCH=self.etag,
            HTTP_IDEMPOTENCY_KEY=f"bench-e2e-{uuid.uuid4().hex}",
        )
        if answer.status_code != 202:
            raise RuntimeError(f"{self.path}: {answer.status_code} {answer.content[:300]!r}")
        action_id = uuid.UUID(answer.json()["id"])
        outcome = action_execute(action_id=action_id)
        if outcome != "applied":
            raise RuntimeError(f"{self.path}: executed as {outcome}")
        done = Operation.objects.get(action_id=action_id, status="done")
        self.etag = f'"{done.result_version}"'


def _save_kind(world: Any, slug: str, target: dict[str, Any]) -> None:
    # reason: Django is set up by web_process_django before this runs
    from approvals.services.rules import auto_approve_rule_create
    from audit.services import Actor
    from bench.fixtures import OWNER_GROUP
    from ownership.services.catalog import resource_kind_save

    classes = {"create": "add_unique", "update": "recompute_field", "delete": "recompute_field"}
    resource_kind_save(
        slug=slug,
        data={"classes": classes, "owner_group": OWNER_GROUP, **target},
        actor=Actor.person(world.admin),
    )
    # Its runs start at once, as bench.fixtures' kinds' do: the figure is the write's cost.
    auto_approve_rule_create(
        actor=Actor.person(world.admin),
        kind=slug,
        operations=["create", "update"],
        description="bench",
    )


def _measure(stack: Stack, rounds: int, scratch: Path) -> dict[str, Any]:
    # reason: Django is set up by web_process_django before this runs
    from bench import fixtures
    from engine.targets.git import GitSettings, GitTarget
    from engine.targets.http_etag import HttpEtagSettings, HttpEtagTarget

    world = fixtures.bootstrap()
    figures: dict[str, Any] = {}
    with ExitStack() as stack_of_targets:
        targets: dict[str, tuple[dict[str, Any], str, Callable[[int], None]]] = {}
        targets["postgres"] = (
            stack_of_targets.enter_context(_postgres_target(stack.database_url)),
            "e2e",
            _bare_update(stack.database_url),
        )
        (scratch / "dav").mkdir()
        dav = stack_of_targets.enter_context(wsgidav_server(scratch / "dav"))
        http = HttpEtagTarget(HttpEtagSettings.from_settings({"base_url": dav}))
        for name in ("e2e.json", "bare.json"):
            http.create(name, {"n": 0}, fence=1, idempotency_key=f"seed-{name}")
        bare_tag = [http.read("bare.json").version or ""]

        def bare_put(i: int) -> None:
            bare_tag[0] = put_if_match(dav, "bare.json", bare_tag[0], i)

        targets["http_etag"] = (
            {"target": "http", "target_url": dav, "target_settings": {"auth_scheme": ""}},
            "e2e.json",
            bare_put,
        )
        repo = scratch / "e2e.git"
        subprocess.run(
            ["git", "init", "-q", "--bare", "--initial-branch=main", str(repo)], check=True
        )
        GitTarget(GitSettings.from_settings({"repository": str(repo)})).create(
            "e2e.json", {"n": 0}, fence=1, idempotency_key="seed"
        )
        index = str(scratch / "bare-index")
        targets["git"] = (
            {"target": "git", "target_settings": {"repository": str(repo), "branch": "main"}},
            "e2e.json",
            lambda i: git_plumbing_commit(repo, index, "bare.json", i),
        )
        for adapter, (target, name, bare) in targets.items():
            slug = f"e2e-{adapter.replace('_', '-')}"
            _save_kind(world, slug, target)
            run = fixtures.run_for(world, [f"{slug}/{name}"], task=f"bench: e2e {adapter}")
            writer = _Writer(slug, name, run.token)
            writer.step(0)  # warm: the kind's adapter, the first statements
            bare(0)
            medians = alternate(rounds, {"end_to_end": writer.step, "bare": bare})
            figures[adapter] = {
                **{f"{k}_ms": v for k, v in medians.items()},
                "ratio": round(medians["end_to_end"] / medians["bare"], 2),
            }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args(argv)
    # No write rate limit in the way of one token's many proposals.
    env = {"AIRLOCK_WRITE_RATE_PER_MINUTE": "1000000"}
    with (
        web_process_django("airlock-targets-e2e-", env) as stack,
        tempfile.TemporaryDirectory() as scratch,
    ):
        figures = _measure(stack, args.rounds, Path(scratch))
    print(json.dumps({"what": "one approved write end to end ÷ the bare target write", **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
