"""schemathesis against the notifications endpoints of /api/v1/openapi.json (a real
uvicorn, every check, an admin token): no 500, answers that match the documented schemas,
bad input refused."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet

from tests.fixtures.api import make_person_with_token, start_api_server, stop_api_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def notify_api_server(transactional_db: Any) -> Iterator[Any]:
    server = start_api_server(
        AIRLOCK_WEBHOOK_ALLOW_HTTP="true",
        AIRLOCK_WEBHOOK_ALLOW_HOSTS="127.0.0.1",
        AIRLOCK_NOTIFY_KEY=Fernet.generate_key().decode(),
    )
    try:
        yield server
    finally:
        stop_api_server(server)


def test_the_notifications_endpoints_hold_under_schemathesis(
    notify_api_server: Any, tmp_path: Path
) -> None:
    admin = make_person_with_token("fuzz-admin", "admins")
    config = tmp_path / "schemathesis.toml"
    # A schema-valid body may still name an address the rules refuse (a 422 naming `url`),
    # and a schema-valid id may name no subscription (404).
    config.write_text(
        "\n".join(
            [
                "[[operations]]",
                'include-path-regex = "/api/v1/(subscriptions|deliveries)"',
                f'headers = {{ Authorization = "Bearer {admin.token}" }}',
                "checks.positive_data_acceptance.expected-statuses = "
                '["2xx", "401", "403", "404", "409", "422", "429"]',
                "",
            ]
        )
    )
    binary = str(Path(sys.executable).parent / "schemathesis")
    result = subprocess.run(
        [
            binary,
            "--config-file",
            str(config),
            "run",
            f"{notify_api_server.url}/api/v1/openapi.json",
            "--include-path-regex",
            "/api/v1/(subscriptions|deliveries)",
            "--checks",
            "all",
            "--max-examples",
            "15",
            "--workers",
            "1",
            "--request-timeout",
            "20",
            "--seed",
            "1",
            "--suppress-health-check",
            "all",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(result.stdout[-20000:])
    print(result.stderr[-5000:])
    assert result.returncode == 0
