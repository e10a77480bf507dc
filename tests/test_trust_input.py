"""Issue 9, items 1, 8 and 11 (second half): a write names exactly one strong
version; hostile JSON is a 4xx problem that changes nothing, wherever Airlock
parses JSON; admin endpoints authorise before they validate; catalog PUTs take
back what GET returned."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from engine.core import jsonsafe
from engine.targets.base import TargetError
from engine.targets.http_etag import HttpEtagSettings, HttpEtagTarget
from ownership.models import ConflictClass, Resource
from tests.fixtures.api import RowCounts, problem

pytestmark = pytest.mark.django_db

PROD = "/api/v1/resources/notification-policy/prod-alerts"
DEEP = b"[" * 100_000 + b"]" * 100_000


def write(api: Any, method: str, token: str, if_match: str, key: str) -> Any:
    body = None if method == "DELETE" else {"severity": "critical"}
    return api.call(
        method,
        PROD,
        token=token,
        body=body,
        headers={"If-Match": if_match, "Idempotency-Key": key},
        content_type="application/merge-patch+json" if method == "PATCH" else "application/json",
    )


# -- item 1: one strong version --------------------------------------------------------


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE"])
def test_it_refuses_if_match_star_on_a_write_with_428_and_records_nothing(
    api: Any, run: Any, prod_alerts: Any, method: str
) -> None:
    before = RowCounts.take()
    body = problem(
        write(api, method, run.token, "*", "key-star-0001"), 428, "precondition_required"
    )
    assert "ETag you read" in body["detail"]
    assert RowCounts.take() == before
    # The key was not consumed: the same key with the tag read is a fresh write.
    assert write(api, method, run.token, '"41"', "key-star-0001").status_code == 202


@pytest.mark.parametrize(
    "if_match", ['"41", "42"', '"40", "41"', '"41", "41"', 'W/"41"', 'W/"41", "41"']
)
@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE"])
def test_it_refuses_a_list_or_a_weak_if_match_with_400_and_records_nothing(
    api: Any, run: Any, prod_alerts: Any, method: str, if_match: str
) -> None:
    before = RowCounts.take()
    body = problem(
        write(api, method, run.token, if_match, "key-list-0001"), 400, "if_match_invalid"
    )
    assert body["header"] == "If-Match" and body["retryable"] is False
    assert RowCounts.take() == before


def test_a_single_strong_tag_is_still_accepted_and_observed(
    api: Any, run: Any, prod_alerts: Any
) -> None:
    response = write(api, "PATCH", run.token, ' "41" ', "key-strong-001")
    assert response.status_code == 202, response.content
    assert json.loads(response.content)["observed_etag"] == '"41"'


@pytest.mark.parametrize("condition", ["*", 'W/"41"', '"40", W/"41"', '"41"'])
def test_reads_keep_rfc_9110_if_none_match(
    api: Any, run: Any, prod_alerts: Any, condition: str
) -> None:
    response = api.get(PROD, token=run.token, headers={"If-None-Match": condition})
    assert response.status_code == 304


def test_the_openapi_document_describes_the_one_strong_tag(api: Any) -> None:
    document = json.loads(api.get("/api/v1/openapi.json").content)
    parameters = document["paths"]["/api/v1/resources/{kind}/{name}"]["patch"]["parameters"]
    if_match = next(p for p in parameters if p["name"] == "If-Match")
    assert "428" in if_match["description"] and "if_match_invalid" in if_match["description"]
    assert if_match["schema"]["pattern"] == r'^[ \t]*"[!#-~]*"[ \t]*$'


# -- item 8: hostile JSON ----------------------------------------------------------------

HOSTILE_BODIES = {
    "lone-surrogate": (b'{"severity": "\\ud800"}', 422),
    "lone-low-surrogate-key": (b'{"\\udc00": 1}', 422),
    "deep": (DEEP, 422),
    "depth-65": (b'{"a":' + b"[" * 64 + b"]" * 64 + b"}", 422),
    "nan": (b'{"severity": NaN}', 400),
    "infinity": (b'{"severity": Infinity}', 400),
    "minus-infinity": (b'{"severity": -Infinity}', 400),
    "overflow": (b'{"severity": 1e999}', 422),
    "nul": (b'{"severity": "a\\u0000b"}', 422),
    "long-key": (b'{"' + b"k" * (jsonsafe.MAX_KEY_CHARS + 1) + b'": 1}', 422),
    "long-string": (b'{"s": "' + b"x" * (jsonsafe.MAX_STRING_CHARS + 1) + b'"}', 422),
    "duplicate-key": (b'{"severity": "a", "severity": "b"}', 422),
    "not-utf8": (b'{"severity": "\xff"}', 400),
    "huge-integer": (b'{"n": ' + b"9" * 5000 + b"}", 422),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
@pytest.mark.parametrize("method", ["PUT", "PATCH"])
def test_a_hostile_write_body_is_a_4xx_problem_and_changes_nothing(
    api: Any, run: Any, prod_alerts: Any, settings: Any, name: str, method: str
) -> None:
    settings.AIRLOCK_MAX_BODY_BYTES = 1024 * 1024
    raw, status = HOSTILE_BODIES[name]
    before = RowCounts.take()
    response = api.call(
        method,
        PROD,
        token=run.token,
        raw=raw,
        headers={"If-Match": '"41"', "Idempotency-Key": f"key-hostile-{name}"},
        content_type="application/merge-patch+json" if method == "PATCH" else "application/json",
    )
    body = problem(response, status, "validation_error")
    if status == 422:
        assert body["errors"] and body["errors"][0]["field"] in ("document", "patch")
    assert RowCounts.take() == before
    assert Resource.objects.get(pk=prod_alerts.pk).version == 41


@pytest.mark.parametrize(
    "raw",
    [
        b'{"task": "\\ud800", "write_set": [{"resource": "dns-record/x-*", '
        b'"operations": ["create"]}]}',
        b'{"task": "t", "ttl_seconds": NaN, "write_set": []}',
        b'{"task": "t", "write_set": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ],
    ids=["lone-surrogate", "nan", "deep"],
)
def test_a_hostile_body_on_a_schema_typed_endpoint_is_a_4xx_problem(
    api: Any, agent: Any, raw: bytes
) -> None:
    before = RowCounts.take()
    response = api.post("/api/v1/runs", token=agent.token, raw=raw)
    assert response.status_code in (400, 422), response.content
    assert problem(response, response.status_code, "validation_error")
    assert RowCounts.take() == before


def test_a_deep_body_on_a_decision_is_a_422_not_a_500(api: Any, operator: Any) -> None:
    response = api.post(
        "/api/v1/approvals/00000000-0000-0000-0000-000000000001/decision",
        token=operator.token,
        raw=b'{"decision": "approve", "comment": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    )
    body = problem(response, 422, "validation_error")
    assert "64" in body["detail"]


def test_the_idempotency_fingerprint_survives_hostile_bytes() -> None:
    from approvals.services.idempotency import canonical_body_hash

    assert canonical_body_hash(DEEP) == canonical_body_hash(DEEP)
    assert canonical_body_hash(b'{"a": NaN}') != canonical_body_hash(b'{"a": null}')
    assert canonical_body_hash(b'{"b":1, "a":2}') == canonical_body_hash(b'{"a":2,"b":1}')


def test_a_hostile_api_cursor_is_a_422(api: Any, operator: Any) -> None:
    from console.api_support import cursor_decode
    from engine.core.errors import DomainError

    cursor = base64.urlsafe_b64encode(DEEP).decode().rstrip("=")
    with pytest.raises(DomainError) as refused:
        cursor_decode(cursor, size=2)
    assert refused.value.code == "validation_error"


def test_a_console_page_with_a_hostile_cursor_is_not_a_500(client: Any, operator: Any) -> None:
    client.force_login(operator.user)
    cursor = base64.urlsafe_b64encode(DEEP).decode().rstrip("=")
    response = client.get("/runs/", {"cursor": cursor})
    assert response.status_code < 500


class _HostileTarget:
    """A local HTTP target that answers every GET with the given raw body."""

    def __init__(self, body: bytes) -> None:
        payload = body

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("ETag", '"7"')
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile_target() -> Iterator[Any]:
    targets: list[_HostileTarget] = []

    def start(body: bytes) -> _HostileTarget:
        target = _HostileTarget(body)
        targets.append(target)
        return target

    yield start
    for target in targets:
        target.close()


@pytest.mark.parametrize(
    "raw",
    [DEEP, b'{"a": NaN}', b'{"a": "\\udfff"}', b'{"a": 1e999}'],
    ids=["deep", "nan", "lone-surrogate", "overflow"],
)
def test_an_http_targets_hostile_answer_is_no_document_never_a_crash(
    hostile_target: Any, raw: bytes
) -> None:
    target = hostile_target(raw)
    with pytest.raises(TargetError, match="not a JSON document"):
        _adapter(target.url).read("doc")


def test_an_http_targets_ordinary_answer_is_parsed(hostile_target: Any) -> None:
    target = hostile_target(b'{"a": [1, 2.5, "x"]}')
    assert _adapter(target.url).read("doc").document == {"a": [1, 2.5, "x"]}


def _adapter(url: str) -> HttpEtagTarget:
    return HttpEtagTarget(HttpEtagSettings.from_settings({"base_url": url, "timeout": 5}))


# -- item 11: authorisation before validation; GET -> edit -> PUT ------------------------

NOT_A_SCHEMA = {"no_such_member": [1, 2, 3]}


@pytest.mark.parametrize(
    ("method", "path", "who"),
    [
        ("PUT", "/api/v1/conflict-classes/new-class", "operator"),
        ("PUT", "/api/v1/resource-kinds/new-kind", "operator"),
        ("POST", "/api/v1/auto-approve-rules", "operator"),
        ("PUT", "/api/v1/auto-approve-rules/1", "operator"),
        ("POST", "/api/v1/kill-switch", "outsider"),
        ("POST", "/api/v1/runs/00000000-0000-0000-0000-000000000001/revoke", "outsider"),
    ],
)
def test_a_person_without_the_role_gets_403_before_the_body_is_validated(
    api: Any, operator: Any, outsider: Any, method: str, path: str, who: str
) -> None:
    person = {"operator": operator, "outsider": outsider}[who]
    before = RowCounts.take()
    problem(api.call(method, path, token=person.token, body=NOT_A_SCHEMA), 403, "forbidden")
    problem(api.call(method, path, token=person.token, raw=b"{not json"), 403, "forbidden")
    problem(api.call(method, path, body=NOT_A_SCHEMA), 401, "unauthenticated")
    assert RowCounts.take() == before


def test_an_admin_still_gets_the_422_with_the_schema_details(api: Any, admin: Any) -> None:
    body = problem(
        api.put("/api/v1/conflict-classes/new-class", token=admin.token, body=NOT_A_SCHEMA),
        422,
        "validation_error",
    )
    assert body["errors"]


def _edit_round_trip(api: Any, admin: Any, path: str, **changes: Any) -> dict[str, Any]:
    """GET `path`, change `changes`, PUT it back: 200 with the changes. Returns the
    document sent."""
    document: dict[str, Any] = json.loads(api.get(path, token=admin.token).content)
    document.update(changes)
    response = api.put(path, token=admin.token, body=document)
    assert response.status_code == 200, response.content
    assert changes.items() <= json.loads(response.content).items()
    return document


def test_a_conflict_class_get_edit_put_round_trip_works(api: Any, admin: Any) -> None:
    path = "/api/v1/conflict-classes/advance_pointer"
    document = _edit_round_trip(api, admin, path, quorum=2)
    assert ConflictClass.objects.get(slug="advance_pointer").quorum == 2
    # The same representation under a new slug would contradict it.
    created = api.put("/api/v1/conflict-classes/copy-of-it", token=admin.token, body=document)
    body = problem(created, 422, "validation_error")
    assert [e["field"] for e in body["errors"]] == ["slug"]
    assert not ConflictClass.objects.filter(slug="copy-of-it").exists()


def test_a_conflict_class_put_names_a_contradicting_derived_member(api: Any, admin: Any) -> None:
    path = "/api/v1/conflict-classes/advance_pointer"
    document = json.loads(api.get(path, token=admin.token).content)
    assert document["retryable_by_agent"] is False
    document["retryable_by_agent"] = True
    before = RowCounts.take()
    body = problem(api.put(path, token=admin.token, body=document), 422, "validation_error")
    assert [e["field"] for e in body["errors"]] == ["retryable_by_agent"]
    assert RowCounts.take() == before
    # Changing the resolver to the agent makes it true: then it matches.
    document["resolver"] = "agent"
    assert api.put(path, token=admin.token, body=document).status_code == 200


def test_a_resource_kind_get_edit_put_round_trip_works(api: Any, agent: Any, admin: Any) -> None:
    path = "/api/v1/resource-kinds/dns-record"
    document = _edit_round_trip(api, admin, path, undo_window_seconds=120)
    document["kind"] = "notification-policy"
    body = problem(api.put(path, token=admin.token, body=document), 422, "validation_error")
    assert [e["field"] for e in body["errors"]] == ["kind"]
    document["kind"] = "dns-record"
    document["updated_at"] = "yesterday"
    body = problem(api.put(path, token=admin.token, body=document), 422, "validation_error")
    assert "updated_at" in body["errors"][0]["field"]
