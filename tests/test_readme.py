"""The README runs as written: its runnable blocks, after `make run`, in a new shell.

A block the README marks `<!-- runnable -->` (shell) is run in order, in one bash session with
the environment a newcomer's new terminal has (no DATABASE_URL / REDIS_URL: the embedded
default `make run` started); the block marked `<!-- runnable: quickstart -->` (Python) is
then saved as quickstart.py and run in that session, exactly as the README says, while a person
approves what it asks for through the API. The only change to the text: the URL's port, since
the test's `make run` listens on a free port instead of 8000.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, free_port, start_make_run

pytestmark = pytest.mark.slow

MARKER = re.compile(
    r"<!-- runnable(?:: (?P<name>[a-z-]+))? -->\n```(?P<lang>\w+)\n(?P<body>.*?)```", re.S
)


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(name or "", language, body) of every block the README marks runnable, in order."""
    text = (ROOT / "README.md").read_text()
    return [(m["name"] or "", m["lang"], m["body"]) for m in MARKER.finditer(text)]


def test_the_readme_marks_its_shell_commands_and_its_quickstart_runnable() -> None:
    blocks = runnable_blocks()
    assert [lang for name, lang, _ in blocks if name == "quickstart"] == ["python"]
    shell = "\n".join(body for name, lang, body in blocks if lang == "sh")
    assert "manage.py agent_create" in shell
    # A new shell has no activated virtualenv: every Python command names .venv's.
    for line in shell.splitlines():
        if "manage.py" in line:
            assert ".venv/bin/python manage.py" in line, line


def _newcomer_env(data_dir: Path, port: int) -> dict[str, str]:
    keep = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER"}
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(AIRLOCK_DATA_DIR=str(data_dir), PORT=str(port), HOST="127.0.0.1")
    env.update(WEB_CONCURRENCY="1", PYTHONUNBUFFERED="1")
    return env


def _api(base: str, token: str, path: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(  # noqa: S310 (loopback)
        base + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 (loopback)
        return json.loads(response.read())


class Approver(threading.Thread):
    """A person on the Approvals page: approves what the quick-start's agent asks for."""

    def __init__(self, base: str, token: str, agent: str) -> None:
        super().__init__(daemon=True)
        self.base, self.token, self.agent = base, token, agent
        self.decided: list[str] = []
        self.stop = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.wait(0.3):
            try:
                page = _api(self.base, self.token, "/api/v1/approvals?status=pending")
                for item in page["items"]:
                    if item.get("agent") != self.agent or item["id"] in self.decided:
                        continue
                    _api(
                        self.base,
                        self.token,
                        f"/api/v1/approvals/{item['id']}/decision",
                        {"decision": "approve", "comment": "README test"},
                    )
                    self.decided.append(item["id"])
            except (urllib.error.URLError, OSError, KeyError) as exc:
                self.errors.append(repr(exc))


def _wait_for(log: Path, needle: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if needle in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            raise AssertionError(f"make run exited {process.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} not printed within {timeout}s:\n{log.read_text()}")


def test_a_newcomer_runs_the_readme_as_written_after_make_run(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    env = _newcomer_env(data_dir, port)
    log = tmp_path / "make-run.log"
    server = start_make_run(env, log)
    approver: Approver | None = None
    try:
        _wait_for(log, "Airlock is running at", server, timeout=120)
        base = f"http://127.0.0.1:{port}"
        blocks = runnable_blocks()
        shell = "\n".join(body for name, lang, body in blocks if lang == "sh")
        quickstart = next(body for name, _, body in blocks if name == "quickstart")
        (tmp_path / "quickstart.py").write_text(quickstart.replace("http://127.0.0.1:8000", base))
        # The person who approves: the admin login's API token, minted as the README's
        # person_create would for someone new.
        admin_token = subprocess.run(
            [".venv/bin/python", "manage.py", "person_create", "admin", "--role", "admin",
             "--new-token"],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=120,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
        approver = Approver(base, admin_token, "deploy-bot")
        approver.start()
        script = f"set -euo pipefail\n{shell}\n.venv/bin/python {tmp_path / 'quickstart.py'}\n"
        done = subprocess.run(
            ["/bin/bash", "-c", script],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{approver.errors}"
        lines = done.stdout.strip().splitlines()
        assert lines[-2].startswith("applied "), done.stdout
        assert lines[-1] == "undo: done", done.stdout  # the undo operation settled
        assert len(approver.decided) >= 2  # the run, then its change
    finally:
        if approver is not None:
            approver.stop.set()
        if server.poll() is None:
            os.killpg(server.pid, 2)
            server.wait(timeout=60)
