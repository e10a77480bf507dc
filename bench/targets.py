"""What the target adapters (engine/targets) cost over the bare target operation.

    python -m bench.targets [--rounds N] [--json]

ONLY THE ADAPTER LAYER: one `adapter.write(...)` against the same target's bare conditional
write, rounds alternated, medians compared as a ratio. Not an approved write end to end — the
adapters are not wired into the executor yet (docs/targets.md), so no proposal, approval,
queue, lock or audit is in these numbers.

- postgres: `PostgresTarget.write` (opens its own connection, one conditional UPDATE) against
  (a) the same UPDATE on an open connection and (b) connect + the same UPDATE + close — the
  adapter opens a connection per call today, so (b) is its like-for-like baseline;
- http_etag: `HttpEtagTarget.write` against one `PUT` with `If-Match` through a fresh httpx
  client (the adapter's transport), both against WsgiDAV on a loopback port;
- git: `GitTarget.write` against the plumbing of one single-file commit on a bare repository
  (hash-object, read-tree + update-index on a temporary index, write-tree, commit-tree,
  update-ref CAS) without the adapter's reads (head, ls-tree, the fence trailer).

PostgreSQL: BENCH_TARGETS_DATABASE_URL, else DATABASE_URL; a table `bench_targets_<pid>` is
created there and dropped. WsgiDAV comes from the dev extra; without it that row is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from engine.targets.base import Outcome, TargetAdapter
from engine.targets.git import GitSettings, GitTarget
from engine.targets.http_etag import HttpEtagSettings, HttpEtagTarget
from engine.targets.postgres import PostgresSettings, PostgresTarget

ENV = "BENCH_TARGETS_DSN"
_ANONYMOUS = ("--auth", "anonymous", "--no-config", "-q")


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def alternate(rounds: int, steps: dict[str, Callable[[int], None]]) -> dict[str, float]:
    """Each step once per round, in turn (so drift hits all alike); median ms per step."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step(i)
            times[name].append(time.perf_counter() - start)
    return {name: _median_ms(samples) for name, samples in times.items()}


class _Versions:
    """The version each contender writes on next (each keeps its own resource)."""

    def __init__(self) -> None:
        self.current: dict[str, str] = {}


def _adapter_step(adapter: TargetAdapter, name: str, versions: _Versions) -> Callable[[int], None]:
    def step(i: int) -> None:
        result = adapter.write(
            name,
            {"n": i, "pad": "x" * (i % 7)},
            expected_version=versions.current[name],
            fence=i + 10,
            idempotency_key=f"bench-{i}",
        )
        if result.outcome is not Outcome.APPLIED or result.version is None:
            raise RuntimeError(f"{name}: {result.outcome} {result.detail}")
        versions.current[name] = result.version

    return step


def bench_postgres(rounds: int, dsn: str) -> dict[str, Any]:
    table = f"bench_targets_{os.getpid()}"
    ident = sql.Identifier(table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (name text PRIMARY KEY, doc jsonb, version bigint, fence bigint)"
            ).format(ident)
        )
    os.environ[ENV] = dsn
    try:
        adapter = PostgresTarget(
            PostgresSettings.from_settings(
                {
                    "credentials_env": ENV,
                    "table": table,
                    "key_column": "name",
                    "document_column": "doc",
                    "version_column": "version",
                    "fence_column": "fence",
                }
            )
        )
        versions = _Versions()
        for name in ("adapter", "open", "connect"):
            created = adapter.create(name, {"n": 0}, fence=1, idempotency_key="seed")
            assert created.version is not None
            versions.current[name] = created.version
        update = sql.SQL(
            "UPDATE {} SET doc = %s, version = version + 1, fence = %s "
            "WHERE name = %s AND version::text = %s AND (fence IS NULL OR fence < %s) "
            "RETURNING version::text"
        ).format(ident)

        def bare(conn: psycopg.Connection[Any], name: str, i: int) -> None:
            row = conn.execute(
                update, [Jsonb({"n": i}), i + 10, name, versions.current[name], i + 10]
            ).fetchone()
            assert row is not None
            versions.current[name] = row[0]

        with psycopg.connect(dsn, autocommit=True) as held:

            def connect_each_time(i: int) -> None:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    bare(conn, "connect", i)

            medians = alternate(
                rounds,
                {
                    "adapter": _adapter_step(adapter, "adapter", versions),
                    "bare_open_connection": lambda i: bare(held, "open", i),
                    "bare_connect_each_time": connect_each_time,
                },
            )
    finally:
        os.environ.pop(ENV, None)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(ident))
    return {
        **{f"{k}_ms": v for k, v in medians.items()},
        "ratio_vs_open_connection": round(medians["adapter"] / medians["bare_open_connection"], 2),
        "ratio_vs_connect_each_time": round(
            medians["adapter"] / medians["bare_connect_each_time"], 2
        ),
    }


@contextmanager
def wsgidav_server(root: Path) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = Path(sys.executable).with_name("wsgidav")
    process = subprocess.Popen(
        [str(command), "-H", "127.0.0.1", "-p", str(port), "-r", str(root), *_ANONYMOUS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(10)


def put_if_match(url: str, name: str, version: str, i: int) -> str:
    """One bare conditional PUT through a fresh httpx client (the adapter's transport); the
    new tag."""
    with httpx.Client(timeout=10) as client:
        response = client.put(
            f"{url}/{name}",
            content=json.dumps({"n": i, "pad": "x" * (i % 7)}).encode(),
            headers={"If-Match": f'"{version}"', "Content-Type": "application/json"},
        )
    if response.status_code >= 300:
        raise RuntimeError(f"bare PUT answered {response.status_code}")
    return str(response.headers["etag"]).strip('"')


def bench_http(rounds: int) -> dict[str, Any]:
    if not Path(sys.executable).with_name("wsgidav").exists():
        return {"skipped": "wsgidav is not installed (the dev extra)"}
    with tempfile.TemporaryDirectory() as root, wsgidav_server(Path(root)) as url:
        adapter = HttpEtagTarget(HttpEtagSettings.from_settings({"base_url": url}))
        versions = _Versions()
        for name in ("adapter", "bare"):
            created = adapter.create(name, {"n": 0}, fence=1, idempotency_key="seed")
            assert created.version is not None
            versions.current[name] = created.version

        def bare(i: int) -> None:
            versions.current["bare"] = put_if_match(url, "bare", versions.current["bare"], i)

        medians = alternate(
            rounds, {"adapter": _adapter_step(adapter, "adapter", versions), "bare_put": bare}
        )
    return {
        **{f"{k}_ms": v for k, v in medians.items()},
        "ratio": round(medians["adapter"] / medians["bare_put"], 2),
    }


_PEOPLE = {
    "GIT_AUTHOR_NAME": "b",
    "GIT_AUTHOR_EMAIL": "b@b",
    "GIT_COMMITTER_NAME": "b",
    "GIT_COMMITTER_EMAIL": "b@b",
}


def _git(
    repo: Path, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args],
        input=stdin,
        capture_output=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    return done.stdout.decode().strip()


def git_plumbing_commit(repo: Path, index: str, name: str, i: int) -> None:
    """The bare git write: one single-file commit on main and its update-ref CAS (hash-object,
    read-tree + update-index on a temporary index, write-tree, commit-tree, update-ref)."""
    head = _git(repo, "rev-parse", "refs/heads/main")
    blob = _git(repo, "hash-object", "-w", "--stdin", stdin=json.dumps({"n": i}).encode())
    on_index = {"GIT_INDEX_FILE": index}
    _git(repo, "read-tree", head, env=on_index)
    _git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{name}", env=on_index)
    tree = _git(repo, "write-tree", env=on_index)
    commit = _git(repo, "commit-tree", tree, "-p", head, "-m", f"bare {i}", env=_PEOPLE)
    _git(repo, "update-ref", "refs/heads/main", commit, head)


def bench_git(rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        repo = Path(scratch) / "bench.git"
        subprocess.run(
            ["git", "init", "-q", "--bare", "--initial-branch=main", str(repo)], check=True
        )
        adapter = GitTarget(GitSettings.from_settings({"repository": str(repo)}))
        versions = _Versions()
        created = adapter.create("adapter.json", {"n": 0}, fence=1, idempotency_key="seed")
        assert created.version is not None
        versions.current["adapter.json"] = created.version
        index = str(Path(scratch) / "index")

        def bare(i: int) -> None:
            git_plumbing_commit(repo, index, "bare.json", i)

        medians = alternate(
            rounds,
            {"adapter": _adapter_step(adapter, "adapter.json", versions), "bare_commit": bare},
        )
    return {
        **{f"{k}_ms": v for k, v in medians.items()},
        "ratio": round(medians["adapter"] / medians["bare_commit"], 2),
    }


def run(rounds: int, dsn: str) -> dict[str, Any]:
    return {
        "what": "adapter layer only: adapter.write vs the bare conditional write (not end to end)",
        "rounds": rounds,
        "postgres": bench_postgres(rounds, dsn),
        "http_etag": bench_http(rounds),
        "git": bench_git(rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = parser.parse_args()
    dsn = os.environ.get("BENCH_TARGETS_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if not dsn:
        sys.exit("set BENCH_TARGETS_DATABASE_URL (or DATABASE_URL)")
    figures = run(args.rounds, dsn)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{figures['what']} — {args.rounds} alternated rounds, medians")
    for target in ("postgres", "http_etag", "git"):
        print(f"  {target:10} {json.dumps(figures[target])}")


if __name__ == "__main__":
    main()
