"""Issue 9 item 8, property-based: over the write endpoints (resource PUT/PATCH/
DELETE and create, POST /runs, undo, decisions), no generated body or header
produces a 5xx, and a refused write changes nothing.

Real PostgreSQL and Redis; hypothesis runs derandomized (the same examples on
every run, no example database) with a modest budget per property.
"""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from approvals.models import (
    Action,
    Approval,
)
from approvals.services.idempotency import KEY_PATTERN
from tests.fixtures.api import PROD_ALERTS, ApiClient, RowCounts
from tests.fixtures.core import applied_prod_alerts_action

pytestmark = pytest.mark.django_db

PROPERTY = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROD = "/api/v1/resources/notification-policy/prod-alerts"


# -- strategies ----------------------------------------------------------------------

# Every character, lone surrogates included (json.dumps escapes them as \udXXX).
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4)
    ),
    max_leaves=12,
)
HOSTILE = [
    b'{"a": "\\ud800"}',
    b'{"a": NaN}',
    b'{"a": -Infinity}',
    b'{"a": 1e999}',
    b'{"a": "\\u0000"}',
    b"[" * 5000 + b"]" * 5000,
    b'{"a": ' + b"{" * 100 + b"}" * 100 + b"}",
    b'{"a": 1, "a": 2}',
    b"\xef\xbb\xbf{}",
    b"\xff\xfe{",
    b"",
    b"null",
]
bodies = st.one_of(
    st.sampled_from(HOSTILE),
    json_values.map(lambda value: json.dumps(value, allow_nan=True).encode()),
    st.binary(max_size=64),
)
header_text = st.text(
    st.sampled_from(string.printable.strip("\r\n\x0b\x0c") + "\xa0\xe9\xff"), max_size=40
)
if_match = st.one_of(
    st.sampled_from(['"41"', "*", 'W/"41"', '"41", "42"', '"41", *', "", '""', '"4\\"1"']),
    header_text,
)
keys = st.one_of(
    st.text(
        st.sampled_from(string.ascii_letters + string.digits + "._:-"), min_size=8, max_size=20
    ),
    header_text,
)
content_types = st.sampled_from(
    ["application/json", "application/merge-patch+json", "text/plain", "", "application/x+json"]
)


def _headers(draw_if_match: str | None, key: str | None, reason: str | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if draw_if_match is not None:
        headers["If-Match"] = draw_if_match
    if key is not None:
        headers["Idempotency-Key"] = key
    if reason is not None:
        headers["Airlock-Reason"] = reason
    return headers


def check(response: Any, before: RowCounts, *, recorded_refusals: tuple[int, ...] = ()) -> None:
    """No 5xx; every 4xx is problem+json; a refusal changed nothing.

    `recorded_refusals`: statuses the contract records on purpose (a stale write's
    412 is audited and stored for replay), which change only audit/idempotency.
    """
    assert response.status_code < 500, response.content[:500]
    if response.status_code < 400:
        return
    assert response["Content-Type"].startswith("application/problem+json")
    body = json.loads(response.content)
    assert body["status"] == response.status_code and body["code"]
    after = RowCounts.take()
    if response.status_code in recorded_refusals:
        assert (after.actions, after.versions, after.runs) == (
            before.actions,
            before.versions,
            before.runs,
        )
    else:
        assert after == before, body


# -- properties -----------------------------------------------------------------------


def _with_hostile_examples(test: Any) -> Any:
    """A fixed set of examples run every time, before the generated ones: each
    hostile body with otherwise well-formed headers, so it reaches the parser."""
    for index, raw in enumerate(HOSTILE):
        for method in ("PUT", "PATCH"):
            test = example(
                method=method,
                name="prod-alerts",
                body=raw,
                content_type="application/json",
                tag=None,
                none_match=None,
                key=f"key-example-{method}-{index}",
                reason=None,
                well_formed=True,
            )(test)
    return test


@PROPERTY
@_with_hostile_examples
@given(
    method=st.sampled_from(["PUT", "PATCH", "DELETE"]),
    name=st.sampled_from(["prod-alerts", "staging-new", "missing", "staging-a"]),
    body=bodies,
    content_type=content_types,
    tag=st.none() | if_match,
    none_match=st.none() | st.sampled_from(["*", '"1"', "x"]),
    key=st.none() | keys,
    reason=st.none() | header_text,
    well_formed=st.booleans(),
)
def test_no_generated_resource_write_is_a_5xx_and_a_refusal_changes_nothing(
    run: Any,
    prod_alerts: Any,
    settings: Any,
    method: str,
    name: str,
    body: bytes,
    content_type: str,
    tag: str | None,
    none_match: str | None,
    key: str | None,
    reason: str | None,
    well_formed: bool,
) -> None:
    settings.AIRLOCK_WRITE_RATE_PER_MINUTE = 1_000_000
    if well_formed:
        # Headers that pass every check before the body: the body decides.
        name, tag, none_match = "prod-alerts", '"41"', None
        key = key if key is not None and KEY_PATTERN.match(key) else "key-well-formed"
        if method == "PATCH":
            content_type = "application/merge-patch+json"
    headers = _headers(tag, key, reason)
    if none_match is not None:
        headers["If-None-Match"] = none_match
    before = RowCounts.take()
    response = ApiClient().call(
        method,
        f"/api/v1/resources/notification-policy/{name}",
        token=run.token,
        raw=body,
        headers=headers,
        content_type=content_type,
    )
    check(response, before, recorded_refusals=(412,))


def post_generated(
    settings: Any,
    path: str,
    token: str,
    body: bytes,
    content_type: str,
    *,
    headers: dict[str, str] | None = None,
) -> None:
    """POST a generated body: no 5xx, and a refusal changes nothing (see check)."""
    settings.AIRLOCK_WRITE_RATE_PER_MINUTE = 1_000_000  # hypothesis sends hundreds
    before = RowCounts.take()
    response = ApiClient().post(
        path, token=token, raw=body, headers=headers, content_type=content_type
    )
    check(response, before)


@PROPERTY
@given(body=bodies, content_type=content_types)
def test_no_generated_run_creation_is_a_5xx_and_a_refusal_changes_nothing(
    agent: Any, settings: Any, body: bytes, content_type: str
) -> None:
    post_generated(settings, "/api/v1/runs", agent.token, body, content_type)


@pytest.fixture
def applied(run: Any, prod_alerts: Any) -> Action:
    action: Action = applied_prod_alerts_action(run.run)
    return action


@PROPERTY
@given(body=bodies, key=st.none() | keys, content_type=content_types)
def test_no_generated_undo_is_a_5xx_and_a_refusal_changes_nothing(
    run: Any, applied: Action, settings: Any, body: bytes, key: str | None, content_type: str
) -> None:
    path = f"/api/v1/actions/{applied.pk}/undo"
    headers = _headers(None, key, None)
    post_generated(settings, path, run.token, body, content_type, headers=headers)


@pytest.fixture
def pending_approval(api: Any, run: Any, prod_alerts: Any) -> Approval:
    action = api.accepted_write(
        run.token, "patch", PROD_ALERTS, {"severity": "critical"}, if_match='"41"'
    )
    approval: Approval = Approval.objects.get(action_id=action["id"])
    return approval


@PROPERTY
@given(body=bodies, content_type=content_types)
def test_no_generated_decision_is_a_5xx_and_a_refusal_changes_nothing(
    pending_approval: Approval, operator: Any, settings: Any, body: bytes, content_type: str
) -> None:
    path = f"/api/v1/approvals/{pending_approval.pk}/decision"
    post_generated(settings, path, operator.token, body, content_type)
