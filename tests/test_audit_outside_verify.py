"""`airlock-audit verify` (clients/python, nothing imported from the server) re-hashes a real
exported chain, or every page of GET /api/v1/audit from a live server, and names the first bad
seq of a tampered or gapped one; with anchors it also catches a history rewritten whole."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from audit.linker import audit_link
from audit.services import Actor, audit_append, audit_append_many
from audit.verify import audit_head
from tests.conftest import ROOT
from tests.fixtures.api import make_person_with_token, start_api_server, stop_api_server
from tests.test_audit_chain_format import AWKWARD, documented_hash

CLIENT_SRC = str(ROOT / "clients" / "python" / "src")
SERVER_PACKAGES = {"audit", "approvals", "console", "ownership", "django"}
# The console script as pip would install it: the [project.scripts] entry point, called;
# then proof that the verifier imported nothing from the server (nor Django).
ENTRY_POINT = """
import importlib, sys, tomllib
pyproject, server_packages, *args = sys.argv[1:]
scripts = tomllib.load(open(pyproject, "rb"))["project"]["scripts"]
module, _, name = scripts["airlock-audit"].partition(":")
try:
    code = getattr(importlib.import_module(module), name)(args)
finally:
    imported = {m.split(".")[0] for m in sys.modules} & set(server_packages.split(","))
    assert not imported, f"the verifier imported {sorted(imported)}"
sys.exit(code)
"""


def airlock_audit(*args: str, cwd: Path, env: dict[str, str] | None = None) -> Any:
    """`airlock-audit <args>` through the client package's entry point ([project.scripts],
    as pip installs it), run where the server's packages cannot be imported (PYTHONPATH: the
    client's source only, cwd a temporary directory), and failing if it imported any of
    them or Django."""
    pyproject = str(ROOT / "clients" / "python" / "pyproject.toml")
    return subprocess.run(
        [sys.executable, "-c", ENTRY_POINT, pyproject, ",".join(sorted(SERVER_PACKAGES)), *args],
        cwd=cwd,
        env={**os.environ, **(env or {}), "PYTHONPATH": CLIENT_SRC},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _load_verifier() -> Any:
    """The client's module itself, loaded from this checkout by path (the shared virtualenv
    has airlock-client installed from another one)."""
    path = Path(CLIENT_SRC) / "airlock_client" / "audit_verify.py"
    spec = importlib.util.spec_from_file_location("airlock_audit_verify_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


verifier = _load_verifier()


def _seed() -> None:
    system = Actor.system("tests")
    for n in range(4):
        audit_append(event_type="test.one", actor=system, resource=f"kind/r{n}", details=AWKWARD)
    audit_append_many([{"event_type": "test.batch", "actor": system} for _ in range(3)])


def _export(path: Path) -> list[dict[str, Any]]:
    call_command("audit_export", jsonl=True, output=str(path), stderr=io.StringIO())
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def _write(path: Path, items: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")


def test_the_entry_point_names_the_verifier() -> None:
    pyproject = tomllib.loads((ROOT / "clients/python/pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["airlock-audit"] == "airlock_client.audit_verify:main"


@pytest.mark.django_db
def test_a_real_export_verifies_and_the_verifier_imports_nothing_from_the_server(
    tmp_path: Path,
) -> None:
    _seed()
    export = tmp_path / "audit.jsonl"
    items = _export(export)
    head_seq, head_hash = audit_head()
    assert len(items) == head_seq == 7
    done = airlock_audit("verify", "--file", str(export), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"ok: 7 events, head #7 {head_hash}"
    as_module = subprocess.run(
        [sys.executable, "-m", "airlock_client.audit_verify", "verify", "--file", "-"],
        input=export.read_text(encoding="utf-8"),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": CLIENT_SRC},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert as_module.returncode == 0 and as_module.stdout == done.stdout, as_module.stderr


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        ("details", "first bad seq 3 (hash mismatch)"),
        # A deleted event: the next one names a hash no event before it has.
        ("gap", "first bad seq 5 (broken link)"),
        ("reordered", "first bad seq 6 (broken link)"),
        ("prev_hash", "first bad seq 6 (broken link)"),
        # The first event deleted: the new first one does not start from the genesis.
        ("first", "first bad seq 2 (broken link)"),
    ],
)
def test_a_tampered_export_fails_naming_the_first_bad_seq(
    tmp_path: Path, tamper: str, message: str
) -> None:
    _seed()
    items = _export(tmp_path / "audit.jsonl")
    if tamper == "details":
        items[2]["details"] = {**items[2]["details"], "z": "forged"}
    elif tamper == "gap":
        del items[3]
    elif tamper == "reordered":
        items[4], items[5] = items[5], items[4]
    elif tamper == "prev_hash":
        items[5]["prev_hash"] = items[3]["hash"]
        items[5]["hash"] = documented_hash(items[5])  # re-hashed, yet linked to the wrong event
    else:
        del items[0]
    tampered = tmp_path / "tampered.jsonl"
    _write(tampered, items)
    done = airlock_audit("verify", "--file", str(tampered), cwd=tmp_path)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert message in done.stderr, done.stderr
    # Newest first, as the API serves them: the same first bad seq, the same problem.
    report = verifier.verify_events(reversed(items))
    assert f"first bad seq {report.first_bad_seq} ({report.problem})" == message


@pytest.mark.django_db
def test_a_history_rewritten_whole_is_caught_by_an_anchor(tmp_path: Path) -> None:
    _seed()
    anchors = tmp_path / "anchors.jsonl"
    call_command("audit_anchor", append=str(anchors), stdout=io.StringIO())
    items = _export(tmp_path / "audit.jsonl")
    assert (
        airlock_audit(
            "verify",
            "--file",
            str(tmp_path / "audit.jsonl"),
            "--anchor",
            str(anchors),
            cwd=tmp_path,
        ).returncode
        == 0
    )
    # A forger rewrites event 3 and re-hashes everything after it: the chain walks whole.
    items[2]["details"] = {"forged": True}
    items[2]["hash"] = documented_hash(items[2])
    for n in range(3, len(items)):
        items[n]["prev_hash"] = items[n - 1]["hash"]
        items[n]["hash"] = documented_hash(items[n])
    rewritten = tmp_path / "rewritten.jsonl"
    _write(rewritten, items)
    assert airlock_audit("verify", "--file", str(rewritten), cwd=tmp_path).returncode == 0
    done = airlock_audit("verify", "--file", str(rewritten), "--anchor", str(anchors), cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert f"anchor #7 {audit_head()[1]}" in done.stderr and "anchors.jsonl line 1" in done.stderr
    assert "event #7 now has hash" in done.stderr


def test_an_unreadable_export_exits_2(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"seq": 1\n', encoding="utf-8")
    done = airlock_audit("verify", "--file", str(broken), cwd=tmp_path)
    assert done.returncode == 2 and "line 1: not JSON" in done.stderr


def _sql(statement: str, params: list[Any]) -> None:
    # The test connection has airlock.audit_maintenance on (conftest): tampering is possible.
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_every_page_of_the_live_api_is_verified_and_a_tamper_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    auditor = make_person_with_token("aude", "auditors")
    _seed()
    with monkeypatch.context() as patched:  # an event on a whole second (see test_audit_serialize)
        patched.setattr(timezone, "now", lambda: datetime(2026, 12, 6, 3, 0, 0, tzinfo=UTC))
        audit_append(event_type="test.whole_second", actor=Actor.system("tests"))
    audit_append_many([{"event_type": "test.more", "actor": Actor.system("t")}] * 450)
    audit_link()
    head_seq, head_hash = audit_head()
    assert head_seq > 400  # three pages of 200 at least
    server = start_api_server()
    try:
        token = {"AIRLOCK_TOKEN": auditor.token}
        done = airlock_audit("verify", "--url", server.url, cwd=tmp_path, env=token)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == f"ok: {head_seq} events, head #{head_seq} {head_hash}"
        # The server's own checkpoint would not notice this edit of an old event; the
        # outside verifier re-hashes every page and names the lowest bad seq.
        _sql("UPDATE audit_auditevent SET details = '{\"forged\": true}' WHERE seq = %s", [5])
        _sql("DELETE FROM audit_auditevent WHERE seq = %s", [300])
        done = airlock_audit("verify", "--url", server.url, cwd=tmp_path, env=token)
        assert done.returncode == 1 and "first bad seq 5 (hash mismatch)" in done.stderr
        wrong = airlock_audit(
            "verify", "--url", server.url, cwd=tmp_path, env={"AIRLOCK_TOKEN": "pt_wrong"}
        )
        assert wrong.returncode == 2 and "answered 401" in wrong.stderr
    finally:
        stop_api_server(server)
