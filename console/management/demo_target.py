"""The demo's non-managed kind (issue 39): `tenant-config`, whose documents are JSON files in
a bare git repository under the data folder (`DATA_DIR/demo-config.git`).

`manage.py demo` makes the repository with `git init --bare` and one file committed as if it
predated Airlock (a plain commit, no Airlock trailers), declares the kind, and then drives the
real flow on it: an agent reads the file through the API (its ETag is the blob id), proposes a
change, an operator approves it, and the worker commits it through the git adapter. A machine
without `git` gets the rest of the demo and a line saying this part was skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from django.conf import settings

from engine.targets.base import child_environment
from ownership.models import ResourceKind, TargetType
from ownership.targets import adapter_for_settings

GIT_KIND = "tenant-config"
GIT_FILE = "acme.json"
GIT_RESOURCE = f"{GIT_KIND}/{GIT_FILE}"
PATH_PREFIX = "tenants/"
SEED_DOCUMENT: dict[str, Any] = {"tenant": "acme", "plan": "team", "seats": 5}
_SEED_AUTHOR = {
    "GIT_AUTHOR_NAME": "Platform team",
    "GIT_AUTHOR_EMAIL": "platform@example.test",
    "GIT_COMMITTER_NAME": "Platform team",
    "GIT_COMMITTER_EMAIL": "platform@example.test",
}


def demo_repository() -> Path:
    return Path(settings.DATA_DIR) / "demo-config.git"


def git_available() -> bool:
    return shutil.which("git") is not None


def _git(repository: Path, *args: str, stdin: str | None = None) -> str:
    # Only this repository's settings: the caller's GIT_DIR and the like must not leak in.
    env = child_environment(drop_prefix="GIT_")
    result = subprocess.run(
        ["git", "--git-dir", str(repository), *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=True,
        env={**env, **_SEED_AUTHOR},
        timeout=30,
    )
    return result.stdout.strip()


def ensure_demo_repository() -> Path:
    """The bare repository with `tenants/acme.json` on `main`; left as it is when a previous
    demo made it already (the story reads whatever version the file is at)."""
    repository = demo_repository()
    if not (repository / "HEAD").exists():
        repository.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["git", "init", "--quiet", "--bare", str(repository)], check=True, timeout=30
        )
        _git(repository, "symbolic-ref", "HEAD", "refs/heads/main")
    has_main = subprocess.run(
        ["git", "--git-dir", str(repository), "rev-parse", "--verify", "--quiet", "main"],
        capture_output=True,
        timeout=30,
    )
    if has_main.returncode == 0:
        return repository
    text = json.dumps(SEED_DOCUMENT, indent=2, sort_keys=True) + "\n"
    blob = _git(repository, "hash-object", "-w", "--stdin", stdin=text)
    inner = _git(repository, "mktree", stdin=f"100644 blob {blob}\t{GIT_FILE}\n")
    root = _git(repository, "mktree", stdin=f"040000 tree {inner}\t{PATH_PREFIX.rstrip('/')}\n")
    commit = _git(repository, "commit-tree", root, "-m", "tenants: acme on the team plan")
    # Create-only (the old value "no ref"): a racing second demo cannot clobber the first.
    _git(repository, "update-ref", "refs/heads/main", commit, "0" * 40)
    return repository


def ensure_git_kind(*, undo_window_seconds: int) -> ResourceKind | None:
    """The repository and the kind on it (its settings checked by the adapter, as the kind
    API does); None when git is not installed."""
    if not git_available():
        return None
    repository = ensure_demo_repository()
    target_settings = {"repository": str(repository), "branch": "main", "path_prefix": PATH_PREFIX}
    adapter_for_settings(TargetType.GIT, "", target_settings)  # TargetConfigError if wrong
    kind, _ = ResourceKind.objects.update_or_create(
        slug=GIT_KIND,
        defaults={
            "description": "Tenants' plans and seats: JSON files in a git repository "
            f"({repository.name} under the data folder), changed by commits.",
            "class_create_id": "add_unique",
            "class_update_id": "replace_shared_document",
            "class_delete_id": "replace_shared_document",
            "owner_group": "platform",
            "target": TargetType.GIT,
            "target_url": "",
            "target_settings": target_settings,
            "undo_window_seconds": undo_window_seconds,
        },
    )
    return kind
