"""Production settings: `check --deploy` is clean with the documented variables, and
running without SECRET_KEY never falls back to a key anyone could read."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, subprocess_env

PRODUCTION = {
    "DEBUG": "false",
    "ALLOWED_HOSTS": "airlock.example.com",
    "SECURE_SSL_REDIRECT": "true",
    "SECURE_HSTS_SECONDS": "31536000",
    "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO",
    "METRICS_TOKEN": "metrics-" + "s" * 32,
    "AIRLOCK_NOTIFY_KEY": "bm90aWZ5LWtleS1mb3ItdGhlLWRlcGxveS1jaGVja3M=",  # a Fernet key
}


def check_deploy(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_is_clean_with_the_production_variables(tmp_path: Path) -> None:
    env = subprocess_env(**PRODUCTION, SECRET_KEY=secrets.token_urlsafe(60))
    env["AIRLOCK_DATA_DIR"] = str(tmp_path)
    result = check_deploy(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_without_secret_key_a_private_generated_key_is_used_and_check_deploy_warns(
    tmp_path: Path,
) -> None:
    env = subprocess_env(**PRODUCTION)
    env.pop("SECRET_KEY", None)
    env["AIRLOCK_DATA_DIR"] = str(tmp_path)
    result = check_deploy(env)
    assert result.returncode != 0
    assert "airlock.W001" in result.stdout + result.stderr
    key_file = tmp_path / "secret_key"
    assert key_file.stat().st_mode & 0o077 == 0  # readable by its owner only
    assert len(key_file.read_text()) >= 50
    # A second process reuses the same key (sessions survive restarts).
    first = key_file.read_text()
    check_deploy(env)
    assert key_file.read_text() == first


def test_secure_cookies_follow_a_deployment_that_names_its_hosts(tmp_path: Path) -> None:
    script = (
        "from django.conf import settings as s; "
        "print(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE)"
    )
    env = subprocess_env(DEBUG="false", ALLOWED_HOSTS="airlock.example.com", SECRET_KEY="x" * 60)
    env["AIRLOCK_DATA_DIR"] = str(tmp_path)

    def printed(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", f"import django; django.setup(); {script}"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    deployed = printed(env)
    assert deployed.stdout.split() == ["True", "True"], deployed.stderr
    env.pop("ALLOWED_HOSTS")
    local = printed(env)
    assert local.stdout.split() == ["False", "False"], local.stderr
