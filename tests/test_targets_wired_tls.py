"""An `http` kind behind TLS with a private CA, governed end to end (issue 39): Apache
httpd's mod_dav over https (mod_ssl; tests/fixtures/dav.py `apache_tls`), its certificate
issued by a CA the test makes (tests/fixtures/tls.py) and no trust store holds. The kind is
made through `PUT /resource-kinds/{kind}` naming the variable with the CA's PEM
(`ca_bundle_env`); a bad name is 422 naming the setting, and a kind without it cannot even
read its probe document (the certificate does not verify). An agent reads through the
target, proposes, an operator approves, a real RQ worker — the CA and the Basic credential in
its environment — writes over https: applied once. Neither the PEM nor the password shows
in any answer, audit detail, worker output or log record. Skipped without apache2 / mod_ssl
or root."""

from __future__ import annotations

import base64
import json
import os
import ssl
import time
import uuid
from typing import Any

import httpx
import pytest

from approvals.models import Action, Approval, Operation
from audit.models import AuditEvent
from tests.fixtures.api import make_active_run, make_agent_with_token, problem
from tests.fixtures.dav import ENV, PASSWORD, USER, Dav
from tests.fixtures.engine import wait_for
from tests.fixtures.tls import CA_ENV

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

KIND = "tls-policy"
NAME = "acme.json"
PATH = f"/api/v1/resources/{KIND}/{NAME}"


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
        "target_settings": {"credentials_env": ENV, "auth_scheme": "Basic", **settings},
        "probe_resource": NAME,
    }


def _server_put(dav: Dav, document: Any) -> None:
    """Someone seeds the file on the server, over https, trusting the test's CA."""
    assert dav.pki is not None
    trust = ssl.create_default_context(cadata=dav.pki.ca_pem)
    with httpx.Client(base_url=dav.url, auth=(USER, PASSWORD), verify=trust) as client:
        answer = client.put(f"/{NAME}", content=json.dumps(document))
    assert answer.status_code in (201, 204), answer.status_code
    time.sleep(1.05)  # Apache tags a file changed within the last second as weak


def _status(action_id: Any) -> str:
    return str(Action.objects.values_list("status", flat=True).get(pk=action_id))


def test_an_https_kind_trusting_a_private_ca_applies_an_approved_write_once(
    api: Any, admin: Any, operator: Any, apache_tls: Dav, rq_worker: Any, caplog: Any
) -> None:
    caplog.set_level("DEBUG")
    assert apache_tls.url.startswith("https://") and apache_tls.pki is not None
    _server_put(apache_tls, {"limit": 1})
    answers: list[bytes] = []

    # The setting is a variable's name: anything else is 422, naming it.
    bad = api.put(
        f"/api/v1/resource-kinds/{KIND}",
        token=admin.token,
        body=_kind_body(apache_tls, ca_bundle_env="-----BEGIN CERTIFICATE-----"),
    )
    answers.append(bad.content)
    assert "ca_bundle_env" in json.dumps(problem(bad, 422, "validation_error"))
    # Without it the kind's probe read meets a certificate nothing here trusts: 422 too.
    untrusted = api.put(
        f"/api/v1/resource-kinds/{KIND}", token=admin.token, body=_kind_body(apache_tls)
    )
    answers.append(untrusted.content)
    said = json.dumps(problem(untrusted, 422, "validation_error"))
    assert "TLS certificate did not verify" in said, said
    made = api.put(
        f"/api/v1/resource-kinds/{KIND}",
        token=admin.token,
        body=_kind_body(apache_tls, ca_bundle_env=CA_ENV),
    )
    answers.append(made.content)
    assert made.status_code in (200, 201), made.content
    assert made.json()["target_settings"]["ca_bundle_env"] == CA_ENV  # the name, not the PEM

    # An agent reads through the target (over https), proposes, an operator approves.
    agent = make_agent_with_token(f"tls-bot-{uuid.uuid4().hex[:6]}")
    run = make_active_run(agent.agent, [{"resource": f"{KIND}/{NAME}", "operations": ["update"]}])
    read = api.get(PATH, token=run.token)
    answers.append(read.content)
    assert read.status_code == 200 and read.json()["document"] == {"limit": 1}, read.content
    proposed = api.put(
        PATH,
        token=run.token,
        body={"limit": 2},
        headers={"If-Match": read["ETag"], "Idempotency-Key": f"tls-{uuid.uuid4().hex}"},
    )
    answers.append(proposed.content)
    assert proposed.status_code == 202 and proposed.json()["status"] == "pending_approval"
    action_id = proposed.json()["id"]
    approval = Approval.objects.get(action_id=action_id, subject="action")
    decided = api.decide(approval.pk, "approve", token=operator.token, comment="over TLS")
    answers.append(decided.content)
    assert decided.status_code == 200, decided.content

    # A real worker with the CA and the credential in its environment writes it, once.
    worker = rq_worker(**{ENV: os.environ[ENV], CA_ENV: os.environ[CA_ENV]})
    wait_for(lambda: _status(action_id) in ("applied", "conflict", "failed"), timeout=40)
    assert _status(action_id) == "applied", worker.output()
    assert json.loads((apache_tls.root / NAME).read_text()) == {"limit": 2}
    attempts = Operation.objects.filter(action_id=action_id)
    assert [a.status for a in attempts] == ["done"]
    done = attempts.get()
    assert done.base_version == read["ETag"].strip('"') != done.result_version
    shown = api.get(f"/api/v1/actions/{action_id}", token=run.token)
    answers.append(shown.content)

    worker.stop()
    basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    pem_lines = [
        line for line in apache_tls.pki.ca_pem.splitlines() if not line.startswith("-----")
    ]
    events = json.dumps(list(AuditEvent.objects.values_list("details", flat=True)))
    places = [*(x.decode() for x in answers), events, worker.output()]
    places += [record.getMessage() for record in caplog.records]
    for place in places:
        assert PASSWORD not in place and basic not in place
        assert not any(line in place for line in pem_lines), place
