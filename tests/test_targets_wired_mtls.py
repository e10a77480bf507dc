"""An `http` kind behind mutual TLS, governed end to end (issue 39): Apache httpd's mod_dav
over https requiring a client certificate (`SSLVerifyClient require`; tests/fixtures/dav.py
`apache_mtls`), the server's and the client's certificates issued by a CA the test makes
(tests/fixtures/tls.py). The kind is made through `PUT /resource-kinds/{kind}` naming the
variables with the CA's PEM (`ca_bundle_env`) and with the client certificate and its key
(`client_cert_env`); a bad name is 422 naming the setting, and a kind without the client
certificate cannot even read its probe document (the server refuses the session).

A worker whose variable holds another CA's client certificate: Apache refuses it with a
TLS 1.3 alert read after the request was written, so each attempt is `unknown` — never
`applied`, never claimed not sent — and the one last read cannot settle it either; the file
on the server is untouched. Then a worker with the right certificate applies an approved
write once. Neither the key nor the Basic credential shows in any answer, audit detail,
worker output or log record. Skipped without apache2 / mod_ssl or root."""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from approvals.models import Action, Approval, Operation
from audit.models import AuditEvent
from tests.fixtures.api import make_active_run, make_agent_with_token, problem
from tests.fixtures.dav import ENV, PASSWORD, USER, Dav
from tests.fixtures.engine import wait_for
from tests.fixtures.tls import CA_ENV, CLIENT_ENV, Pki, another_client_pem

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

KIND = "mtls-policy"
NAME = "acme.json"
PATH = f"/api/v1/resources/{KIND}/{NAME}"
FAST_RETRIES = {"AIRLOCK_MAX_ATTEMPTS": "2", "AIRLOCK_BACKOFF_BASE_SECONDS": "0.2"}
FINAL = ("applied", "conflict", "failed")


def _kind_body(dav: Dav, **settings: Any) -> dict[str, Any]:
    return {
        "classes": {
            "create": "add_unique",
            "update": "replace_shared_document",  # each call waits for a person
            "delete": "replace_shared_document",
        },
        "owner_group": "platform",
        "target": "http",
        "target_url": dav.url,
        "target_settings": {
            "credentials_env": ENV,
            "auth_scheme": "Basic",
            "ca_bundle_env": CA_ENV,
            **settings,
        },
        "probe_resource": NAME,
    }


def _pki(dav: Dav) -> Pki:
    assert dav.pki is not None
    return dav.pki


def _server_put(dav: Dav, document: Any) -> None:
    """Someone seeds the file on the server, over https, with the client certificate."""
    pki = _pki(dav)
    trust = ssl.create_default_context(cadata=pki.ca_pem)
    with tempfile.TemporaryDirectory() as folder:
        identity = Path(folder) / "client.pem"
        identity.write_text(pki.client_pem)
        trust.load_cert_chain(identity)
    with httpx.Client(base_url=dav.url, auth=(USER, PASSWORD), verify=trust) as client:
        answer = client.put(f"/{NAME}", content=json.dumps(document))
    assert answer.status_code in (201, 204), answer.status_code
    time.sleep(1.05)  # Apache tags a file changed within the last second as weak


def _status(action_id: Any) -> str:
    return str(Action.objects.values_list("status", flat=True).get(pk=action_id))


def _propose_and_approve(
    api: Any, run: Any, operator: Any, document: Any, answers: list[bytes]
) -> tuple[str, str]:
    """The run reads the document through the target, proposes `document`, the operator
    approves. (action id, the ETag read)"""
    read = api.get(PATH, token=run.token)
    answers.append(read.content)
    assert read.status_code == 200, read.content
    proposed = api.put(
        PATH,
        token=run.token,
        body=document,
        headers={"If-Match": read["ETag"], "Idempotency-Key": f"mtls-{uuid.uuid4().hex}"},
    )
    answers.append(proposed.content)
    assert proposed.status_code == 202 and proposed.json()["status"] == "pending_approval"
    action_id: str = proposed.json()["id"]
    approval = Approval.objects.get(action_id=action_id, subject="action")
    decided = api.decide(approval.pk, "approve", token=operator.token, comment="over mTLS")
    answers.append(decided.content)
    assert decided.status_code == 200, decided.content
    return action_id, read["ETag"]


def test_an_https_kind_presenting_a_client_certificate_applies_an_approved_write_once(
    api: Any, admin: Any, operator: Any, apache_mtls: Dav, rq_worker: Any, caplog: Any
) -> None:
    caplog.set_level("DEBUG")
    pki = _pki(apache_mtls)
    _server_put(apache_mtls, {"limit": 1})
    answers: list[bytes] = []

    # The setting is a variable's name: anything else is 422, naming it.
    bad = api.put(
        f"/api/v1/resource-kinds/{KIND}",
        token=admin.token,
        body=_kind_body(apache_mtls, client_cert_env="-----BEGIN PRIVATE KEY-----"),
    )
    answers.append(bad.content)
    assert "client_cert_env" in json.dumps(problem(bad, 422, "validation_error"))
    # Without it the server refuses the kind's probe read: 422 too, saying why.
    refused = api.put(
        f"/api/v1/resource-kinds/{KIND}", token=admin.token, body=_kind_body(apache_mtls)
    )
    answers.append(refused.content)
    said = json.dumps(problem(refused, 422, "validation_error"))
    assert "the server refused a connection without a client certificate" in said, said
    made = api.put(
        f"/api/v1/resource-kinds/{KIND}",
        token=admin.token,
        body=_kind_body(apache_mtls, client_cert_env=CLIENT_ENV),
    )
    answers.append(made.content)
    assert made.status_code in (200, 201), made.content
    assert made.json()["target_settings"]["client_cert_env"] == CLIENT_ENV  # the name only

    agent = make_agent_with_token(f"mtls-bot-{uuid.uuid4().hex[:6]}")
    run = make_active_run(agent.agent, [{"resource": f"{KIND}/{NAME}", "operations": ["update"]}])
    variables = {ENV: os.environ[ENV], CA_ENV: os.environ[CA_ENV]}

    # 1. A worker presenting another CA's certificate: refused after the request was
    # written (TLS 1.3), so never `applied` and never "not sent" — unknown, and the last
    # read cannot settle it. (It runs first: a killed worker's RQ scheduler lock outlives
    # it by a minute, and these attempts are retries the scheduler enqueues.)
    other = another_client_pem()
    refused_id, _ = _propose_and_approve(api, run, operator, {"limit": 50}, answers)
    lacking = rq_worker(**FAST_RETRIES, **variables, **{CLIENT_ENV: other})
    wait_for(lambda: _status(refused_id) in FINAL, timeout=60)
    assert _status(refused_id) == "failed", lacking.output()
    first, *reads = Operation.objects.filter(action_id=refused_id).order_by("started_at")
    said = (
        f"the server refused the client certificate in {CLIENT_ENV} (TLS: tlsv1 alert unknown ca)"
    )
    assert first.status == "unknown", first.outcome
    unknown = str(first.outcome["unknown"])
    assert said in unknown and "after the request was written (TLS 1.3)" in unknown, unknown
    # The next attempts settle by reading first — refused the same way: nothing re-sent.
    assert reads and all(a.status == "failed" for a in reads)
    assert all(str(a.outcome["refused"]).startswith("target_unreadable") for a in reads)
    error = Action.objects.get(pk=refused_id).error
    assert (error["code"], error["outcome"], error["last_read"]) == (
        "attempts_exhausted",
        "unknown",
        "unsettled",
    ), error
    applied = AuditEvent.objects.filter(event_type="write.applied", action_id=refused_id)
    assert not applied.exists()
    assert json.loads((apache_mtls.root / NAME).read_text()) == {"limit": 1}  # untouched
    shown = api.get(f"/api/v1/actions/{refused_id}", token=run.token)
    answers.append(shown.content)
    lacking.stop()

    # 2. A worker with the right certificate: the approved write lands, once.
    action_id, etag = _propose_and_approve(api, run, operator, {"limit": 2}, answers)
    worker = rq_worker(**variables, **{CLIENT_ENV: os.environ[CLIENT_ENV]})
    wait_for(lambda: _status(action_id) in FINAL, timeout=40)
    assert _status(action_id) == "applied", worker.output()
    assert json.loads((apache_mtls.root / NAME).read_text()) == {"limit": 2}
    done = Operation.objects.filter(action_id=action_id)
    assert [a.status for a in done] == ["done"]
    assert done.get().base_version == etag.strip('"') != done.get().result_version
    shown = api.get(f"/api/v1/actions/{action_id}", token=run.token)
    answers.append(shown.content)

    worker.stop()
    basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    key_lines = [
        line
        for key in (pki.client_key_pem, other)
        for line in key.splitlines()
        if line and not line.startswith("-----")
    ]
    events = json.dumps(list(AuditEvent.objects.values_list("details", flat=True)))
    outcomes = json.dumps(list(Operation.objects.values_list("outcome", flat=True)))
    places = [*(x.decode() for x in answers), events, outcomes, lacking.output()]
    places += [worker.output(), *(record.getMessage() for record in caplog.records)]
    for place in places:
        assert PASSWORD not in place and basic not in place
        assert not any(line in place for line in key_lines), place
