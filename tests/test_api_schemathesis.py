"""schemathesis against /api/v1/openapi.json on a real uvicorn server, with every
check (server errors, status / content-type / header / schema conformance,
negative data rejection, ignored auth, ...) and valid tokens per operation so
business logic is reached."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from approvals.models import AutoApproveRule
from tests.fixtures.api import (
    ensure_api_kinds,
    make_active_run,
    make_agent_with_token,
    make_person_with_token,
)
from tests.fixtures.core import make_resource

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MAX_EXAMPLES = 12


def _operation_block(
    name_regex: str,
    token: str,
    extra_statuses: tuple[int, ...] = (),
    missing_header_statuses: tuple[int, ...] = (),
    negative_statuses: tuple[int, ...] = (),
) -> str:
    """One [[operations]] entry: its token, and the statuses its business rules add."""
    lines = [
        "[[operations]]",
        f'include-name-regex = "{name_regex}"',
        f'headers = {{ Authorization = "Bearer {token}" }}',
    ]
    if extra_statuses:
        statuses = ["2xx", "3xx", "401", "403", "404", "409", "429", *map(str, extra_statuses)]
        quoted = ", ".join(f'"{status}"' for status in statuses)
        lines.append(f"checks.positive_data_acceptance.expected-statuses = [{quoted}]")
    if missing_header_statuses:
        statuses = [
            "400",
            "401",
            "403",
            "406",
            "415",
            "422",
            *map(str, missing_header_statuses),
        ]
        quoted = ", ".join(f'"{status}"' for status in statuses)
        lines.append(f"checks.missing_required_header.expected-statuses = [{quoted}]")
    if negative_statuses:
        # schemathesis' default rejection statuses, plus the given ones.
        default = (400, 401, 403, 404, 405, 406, 409, 415, 422, 428, 429)
        quoted = ", ".join(f'"{status}"' for status in (*default, *negative_statuses))
        lines.append(f'checks.negative_data_rejection.expected-statuses = [{quoted}, "5xx"]')
    return "\n".join(lines) + "\n"


def _config(run_token: str, lifecycle_token: str, agent_token: str, admin_token: str) -> str:
    """Per-operation tokens. Besides the defaults, a schema-valid request may
    legitimately meet a business precondition: 412/428 (If-Match), 422 (a kind
    that does not exist: the contract's answer), 423 (lease)."""

    people = (
        "approvals|conflicts|audit|kill-switch|conflict-classes|resource-kinds|auto-approve-rules"
    )
    return "\n".join(
        [
            # schemathesis' coverage phase does not honour `pattern` on optional
            # headers, so a malformed If-Match (400 bad_header) counts as "valid".
            # The contract checks run active / write set / lease before the
            # Idempotency-Key, so a missing key may meet 409/423 first; so may a
            # malformed header or body (the fuzzer grants leases through POST /runs
            # and approvals).
            _operation_block(
                "^(PUT|PATCH|DELETE) /api/v1/resources/",
                run_token,
                (400, 412, 422, 423, 428),
                missing_header_statuses=(409, 423),
                negative_statuses=(423,),
            ),
            _operation_block("^POST /api/v1/runs$", agent_token, (422,)),
            # A plan is checked step by step like single writes (write set, lease, If-Match
            # syntax and freshness) and refused whole; the fuzzer's run ids are not the
            # token's run (404).
            _operation_block(
                "^POST /api/v1/runs/[^/]+/plans$",
                run_token,
                (400, 412, 422, 423, 428),
                missing_header_statuses=(404, 409, 423),
                negative_statuses=(423,),
            ),
            # JSON safety (engine/core/jsonsafe.py, issue 9) refuses U+0000 and lone
            # surrogates in any key or string with a 422: stricter than JSON Schema can say,
            # so a schema-valid body carrying them is a legitimate 422 wherever text is taken.
            _operation_block("^POST /api/v1/runs/[^/]+/revoke$", admin_token, (422,)),
            # Heartbeat/finish (and the run listing that feeds the stateful phase
            # their ids) use a second run, so finishing it never stops the run
            # the writes are made with.
            _operation_block("^POST /api/v1/runs/", lifecycle_token),
            _operation_block("^GET /api/v1/runs", lifecycle_token),
            _operation_block("^POST /api/v1/actions/", run_token),
            # A kind naming conflict classes that do not exist is a 422.
            _operation_block("^PUT /api/v1/resource-kinds/", admin_token, (422,)),
            # Read-only members (slug, retryable_by_agent) that contradict the path or
            # the resolver are a 422 naming them (GET -> edit -> PUT, issue 9).
            _operation_block("^PUT /api/v1/conflict-classes/", admin_token, (422,)),
            # A rule naming a kind or an agent that does not exist is a 422.
            _operation_block("^(POST|PUT) /api/v1/auto-approve-rules", admin_token, (422,)),
            _operation_block(
                "^POST /api/v1/(conflicts|approvals|kill-switch)", admin_token, (422,)
            ),
            # A webhook URL the address rules refuse, a URL on an email subscription: 422.
            _operation_block("^(POST|PATCH) /api/v1/subscriptions", admin_token, (422,)),
            _operation_block(f"^(GET|POST|PUT|DELETE) /api/v1/({people})", admin_token),
            _operation_block("^GET /api/v1/(runs|resources|whoami|actions|plans)", run_token),
        ]
    )


def test_the_openapi_document_holds_under_schemathesis(api_server: Any, tmp_path: Path) -> None:
    ensure_api_kinds()
    make_resource("notification-policy/prod-alerts", {"severity": "warning"}, version=41)
    AutoApproveRule.objects.create(kind_id="dns-record", name_prefix="fuzz-", operations=["create"])
    agent = make_agent_with_token("fuzz-bot")
    run = make_active_run(agent.agent)
    lifecycle = make_active_run(
        agent.agent, [{"resource": "dns-record/lifecycle-*", "operations": ["create"]}]
    )
    admin = make_person_with_token("fuzz-admin", "admins", "operators", "platform")
    config = tmp_path / "schemathesis.toml"
    config.write_text(_config(run.token, lifecycle.token, agent.token, admin.token))
    binary = str(Path(sys.executable).parent / "schemathesis")
    result = subprocess.run(
        [
            binary,
            "--config-file",
            str(config),
            "run",
            f"{api_server.url}/api/v1/openapi.json",
            "--checks",
            "all",
            "--max-examples",
            str(MAX_EXAMPLES),
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
