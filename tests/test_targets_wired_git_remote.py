"""A kind whose documents are files in a REMOTE git repository with credentials, governed end
to end through the kind API, the resource API, approvals and a real RQ worker (issue 39), on
real servers, each shared by the module:

- an http remote: Debian's `git-http-backend` behind Apache httpd with Basic auth
  (tests/fixtures/git_http.py); the kind's `credentials_env` names the variable holding
  `user:password`;
- an ssh remote: Debian's OpenSSH `sshd` on a free port (tests/fixtures/sshd.py); the kind's
  `ssh_key_env` / `ssh_known_hosts_env` / `ssh_key_passphrase_env` name the variables holding
  the private key's text (protected by a passphrase), the pinned host key and the passphrase;
- an https remote, for one test: the http remote behind Apache's mod_ssl, its certificate
  from a CA the test makes (tests/fixtures/tls.py); the kind's `ca_bundle_env` names the
  variable holding the CA's PEM. A worker whose variable holds another CA sends nothing
  (`not_sent` at the handshake, `failed` after the attempts, nothing pushed); one trusting
  it lands an approved write as one commit, two runs from one version as one commit and
  one conflict;
- the same https remote requiring a client certificate (`SSLVerifyClient require`), for one
  test: the kind names `client_cert_env` too. A worker presenting another CA's certificate
  pushes nothing (refused at git's first request, the refs: `not_sent`, then `failed`); one
  presenting the right one lands an approved write as one commit; the key shows nowhere.

The worker reads the variables from its own environment at call time; the test checks the
remote itself by cloning it. An approved write lands once, its commit naming run, action and
approver; undo restores the prior content; two runs from one version → one applied, one
conflict; undo after someone else pushed → a conflict, nothing overwritten; the remote down →
backoff, then `failed`; the credential shows in no answer, audit detail, worker output or log
record. Skipped where apache2 (mod_ssl) / sshd are not installed or we are not root.

Two runs cannot both hold write authority over one resource (the write set's overlap rule),
so the second run's action is recorded as the engine tests record it (a run outside the
write-set rules), and both are approved through the API and executed by the worker.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from approvals.models import Action, Approval, Operation
from approvals.services.tokens import personal_token_create
from audit.models import AuditEvent
from audit.services import Actor
from ownership.models import Conflict, ResourceKind
from ownership.targets import read_through
from tests.fixtures import git_http, sshd
from tests.fixtures.api import make_active_run, make_agent_with_token
from tests.fixtures.engine import wait_for
from tests.fixtures.targets import git
from tests.fixtures.tls import Pki, another_ca_pem, another_client_pem, server_pki

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

KIND, NAME = "remote-config", "acme.json"
FILE = f"tenants/{NAME}"
PATH = f"/api/v1/resources/{KIND}/{NAME}"
HTTP_ENV = "AIRLOCK_TEST_GITREMOTE_CREDENTIALS"
KEY_ENV, HOSTS_ENV = "AIRLOCK_TEST_GITREMOTE_SSH_KEY", "AIRLOCK_TEST_GITREMOTE_KNOWN_HOSTS"
PASS_ENV, PASSPHRASE = "AIRLOCK_TEST_GITREMOTE_SSH_PASSPHRASE", "wired passphrase 39"
CA_ENV = "AIRLOCK_TEST_GITREMOTE_CA_BUNDLE"
CLIENT_ENV = "AIRLOCK_TEST_GITREMOTE_CLIENT_CERT"
# Attempts and backoff short enough for a test, long enough to see the backoff.
FAST_RETRIES = {"AIRLOCK_MAX_ATTEMPTS": "3", "AIRLOCK_BACKOFF_BASE_SECONDS": "0.2"}
FINAL = ("applied", "conflict", "failed")


@dataclass
class Server:
    """One running server for the whole module and what a kind needs to reach it."""

    repos: Path  # where its bare repositories live
    url_of: Callable[[Path], str]
    clone_url_of: Callable[[Path], str]  # how the test's own git reaches a repository
    client_env: dict[str, str]  # and with what environment
    credentials: dict[str, str]  # variable → value, as the worker reads them
    settings: dict[str, str]  # the kind's settings naming those variables
    secrets: list[str]  # texts that must show nowhere
    start: Callable[[], None]
    stop: Callable[[], None]
    owner: str | None = None  # who must own a served repository (Apache's user)


def _http_server(pki: Pki | None = None, *, verify_clients: bool = False) -> Iterator[Server]:
    """The http remote; with a Pki the same over https, its certificate from that CA (and
    with `verify_clients`, only to clients presenting the Pki's client certificate)."""
    if not (git_http.HAVE_GIT_HTTPS if pki else git_http.HAVE_GIT_HTTP):
        pytest.skip(git_http.HTTPS_SKIP_REASON if pki else git_http.SKIP_REASON)
    apache = git_http.git_http_server(pki, verify_clients=verify_clients)

    def start() -> None:  # again after a test stopped it; a no-op while it runs
        if apache.process is None:
            apache.start()

    start()
    credential = f"{git_http.USER}:{git_http.PASSWORD}"
    credentials, settings = {HTTP_ENV: credential}, {"credentials_env": HTTP_ENV}
    secrets = [git_http.PASSWORD, base64.b64encode(credential.encode()).decode()]
    client_env: dict[str, str] = {}
    if pki is not None:  # the kind names the CA's variable; the test's own git reads a file
        credentials[CA_ENV] = pki.ca_pem
        settings["ca_bundle_env"] = CA_ENV
        secrets += [line for line in pki.ca_pem.splitlines() if not line.startswith("-----")]
        ca_file = apache.scratch[0] / "ca.pem"
        ca_file.write_text(pki.ca_pem)
        client_env["GIT_SSL_CAINFO"] = str(ca_file)
    if pki is not None and verify_clients:  # the kind names the certificate's variable too
        credentials[CLIENT_ENV] = pki.client_pem
        settings["client_cert_env"] = CLIENT_ENV
        secrets += [line for line in pki.client_key_pem.splitlines() if "-----" not in line]
        client_file = apache.scratch[0] / "client.pem"
        client_file.write_text(pki.client_pem)
        client_file.chmod(0o600)
        client_env["GIT_SSL_CERT"] = client_env["GIT_SSL_KEY"] = str(client_file)
    scheme = "https" if pki else "http"
    try:
        yield Server(
            repos=apache.root,
            url_of=lambda repo: f"{apache.url}/git/{repo.name}",
            # The test's own clones: the credential in the URL (never in what is checked).
            clone_url_of=lambda repo: (
                f"{scheme}://{credential}@127.0.0.1:{apache.port}/git/{repo.name}"
            ),
            client_env=client_env,
            credentials=credentials,
            settings=settings,
            secrets=secrets,
            start=start,
            stop=apache.stop,
            owner="www-data",
        )
    finally:
        apache.stop()
        for folder in apache.scratch:
            shutil.rmtree(folder, ignore_errors=True)


def _ssh_server() -> Iterator[Server]:
    if not sshd.HAVE_SSHD:
        pytest.skip(sshd.SKIP_REASON)
    with sshd.ssh_server() as server:
        repos = server.base / "repos"
        repos.mkdir()
        # The worker's key is protected by a passphrase (ssh_key_passphrase_env, read by ssh
        # through the adapter's askpass); the test's own clones use the plain client key.
        # One KDF round (ssh-keygen's default is 16): each ssh login derives the key again,
        # and this module must not get slower for it.
        locked, _ = server.authorised_key(PASSPHRASE, rounds=1)
        body = [line for line in locked.splitlines() if not line.startswith("-----")]
        (server.base / "known_hosts").write_text(server.known_hosts)
        ssh = (
            f"ssh -F /dev/null -i {server.base / 'client_ed25519'} -o IdentitiesOnly=yes "
            f"-o BatchMode=yes -o StrictHostKeyChecking=yes "
            f"-o UserKnownHostsFile={server.base / 'known_hosts'}"
        )
        yield Server(
            repos=repos,
            url_of=server.url,
            clone_url_of=server.url,
            client_env={"GIT_SSH_COMMAND": ssh},
            credentials={KEY_ENV: locked, HOSTS_ENV: server.known_hosts, PASS_ENV: PASSPHRASE},
            settings={
                "ssh_key_env": KEY_ENV,
                "ssh_known_hosts_env": HOSTS_ENV,
                "ssh_key_passphrase_env": PASS_ENV,
            },
            secrets=[*(line for line in body if line.strip()), PASSPHRASE],
            start=server.start,
            stop=server.stop,
        )


@pytest.fixture(scope="module", params=["http", "ssh"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """http or ssh; "https" and "https-mtls" only where a test asks for it (indirect
    parametrisation)."""
    if request.param == "ssh":
        yield from _ssh_server()
    elif request.param == "https-mtls":
        yield from _http_server(server_pki(), verify_clients=True)
    else:
        yield from _http_server(server_pki() if request.param == "https" else None)


@dataclass(frozen=True)
class Seen:
    document: Any
    blob: str
    messages: list[str]  # newest first


@dataclass
class Remote:
    server: Server
    repo: Path  # the served bare repository
    mirror: Path
    scratch: Path

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "repository": self.server.url_of(self.repo),
            "mirror": str(self.mirror),
            "branch": "main",
            "path_prefix": "tenants/",
            "timeout": 10,
            **self.server.settings,
        }

    def _git(self, *args: str, cwd: Path | None = None) -> str:
        """The test's own git, through the server like anyone else."""
        return subprocess.run(
            ["git", "-c", "user.name=Someone", "-c", "user.email=someone@example.com", *args],
            cwd=cwd,
            env={**os.environ, **self.server.client_env},
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    def clone(self) -> Path:
        """A fresh clone of the remote, through its server (what anyone would see)."""
        where = self.scratch / f"clone-{uuid.uuid4().hex[:8]}"
        url = self.server.clone_url_of(self.repo)
        self._git("clone", "--quiet", "--branch", "main", url, str(where))
        return where

    def look(self) -> Seen:
        """The file and the history as a fresh clone of the remote shows them."""
        clone = self.clone()
        log = self._git("log", "--format=%B%x00", "HEAD", cwd=clone)
        return Seen(
            document=json.loads((clone / FILE).read_text()),
            blob=self._git("rev-parse", f"HEAD:{FILE}", cwd=clone),
            messages=[m.strip() for m in log.split("\x00") if m.strip()],
        )

    def someone_pushes(self, document: Any) -> None:
        """Someone else's commit of the file, pushed to the remote outside Airlock."""
        clone = self.clone()
        (clone / FILE).write_text(json.dumps(document))
        self._git("commit", "--quiet", "-am", f"someone edits {FILE}", cwd=clone)
        self._git("push", "--quiet", "origin", "main", cwd=clone)


@pytest.fixture
def remote(server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Remote:
    """A new served repository holding tenants/acme.json = {"limit": 1} (someone's commit);
    the credential variables set in this process (the API's reads) as in the worker's."""
    server.start()  # a no-op when it runs; back after a test that stopped it
    for name, value in server.credentials.items():
        monkeypatch.setenv(name, value)
    repo = server.repos / f"config-{uuid.uuid4().hex[:8]}.git"
    git("init", "--quiet", "--bare", "--initial-branch=main", str(repo))
    seed = tmp_path / "seed"
    git("init", "--quiet", "--initial-branch=main", str(seed))
    (seed / "tenants").mkdir()
    (seed / FILE).write_text(json.dumps({"limit": 1}))
    git("add", FILE, cwd=seed)
    git("commit", "--quiet", "-m", "someone seeds the file", cwd=seed)
    git("push", "--quiet", str(repo), "main", cwd=seed)
    if server.owner:
        git_http.serve_to_apache(repo)
    return Remote(server, repo, tmp_path / "mirror.git", tmp_path)


def _put_kind(api: Any, admin: Any, remote: Remote, answers: list[bytes]) -> ResourceKind:
    body = {
        "classes": {
            "create": "add_unique",
            "update": "replace_shared_document",  # each call waits for a person
            "delete": "replace_shared_document",
        },
        "owner_group": "platform",
        "target": "git",
        "target_settings": remote.settings,
        "probe_resource": NAME,
    }
    answer = api.put(f"/api/v1/resource-kinds/{KIND}", token=admin.token, body=body)
    answers.append(answer.content)
    assert answer.status_code in (200, 201), answer.content
    assert answer.json()["capabilities"] == {"holds_fence": True, "takes_idempotency_key": False}
    return ResourceKind.objects.get(slug=KIND)


def _status(action_id: Any) -> str:
    return str(Action.objects.values_list("status", flat=True).get(pk=action_id))


def _approve(api: Any, action_id: Any, token: str, answers: list[bytes]) -> None:
    approval = Approval.objects.get(action_id=action_id, subject="action")
    decided = api.decide(approval.pk, "approve", token=token, comment="looks right")
    answers.append(decided.content)
    assert decided.status_code == 200, decided.content


def _agent_run() -> Any:
    agent = make_agent_with_token(f"config-bot-{uuid.uuid4().hex[:6]}")
    return make_active_run(agent.agent, [{"resource": f"{KIND}/{NAME}", "operations": ["update"]}])


def _propose(api: Any, run: Any, etag: str, document: Any, answers: list[bytes]) -> str:
    proposed = api.put(
        PATH,
        token=run.token,
        body=document,
        headers={"If-Match": etag, "Idempotency-Key": f"remote-{uuid.uuid4().hex}"},
    )
    answers.append(proposed.content)
    assert proposed.status_code == 202, proposed.content
    assert proposed.json()["status"] == "pending_approval"  # the class asks a person
    action_id: str = proposed.json()["id"]
    return action_id


def _an_approved_write_lands_once(
    api: Any, run: Any, token: str, remote: Remote, rq_worker: Any, answers: list[bytes]
) -> tuple[str, Operation, Any]:
    """A run reads the file (its blob id is the tag) = {"limit": 1}, proposes {"limit": 2},
    the holder of `token` (ana) approves, a worker with the server's variables pushes: one
    commit on the remote naming run, action and approver. (action id, its operation, the
    worker)"""
    read = api.get(PATH, token=run.token)
    answers.append(read.content)
    assert read.status_code == 200, read.content
    assert read.json()["document"] == {"limit": 1}
    blob = read["ETag"].strip('"')
    assert blob == remote.look().blob  # the file's blob id on the remote, not a counter
    action_id = _propose(api, run, read["ETag"], {"limit": 2}, answers)
    _approve(api, action_id, token, answers)
    worker = rq_worker(**remote.server.credentials)
    wait_for(lambda: _status(action_id) in FINAL, timeout=40)
    assert _status(action_id) == "applied", worker.output()
    seen = remote.look()
    assert seen.document == {"limit": 2}
    assert len(seen.messages) == 2  # the seed and our write
    ours = seen.messages[0]
    assert f"Airlock-Action: {action_id}" in ours
    assert f"Airlock-Run: {run.run.pk}" in ours and "Approved-by: ana" in ours
    done = Operation.objects.get(action_id=action_id, undo_of__isnull=True, status="done")
    assert (done.base_version, done.result_version) == (blob, seen.blob)
    return action_id, done, worker


def _two_runs_from_one_version(
    api: Any,
    kind: ResourceKind,
    engine_world: Any,
    remote: Remote,
    token: str,
    answers: list[bytes],
    worker: Any,
    *,
    version: str,
    commits: int,
) -> Any:
    """Two runs read the file at `version` (the mirror's) and each proposes a change, both
    approved: one commit lands (the remote then holds `commits`), the other meets the moved
    file and is a conflict. The winner's action."""
    mirror = read_through(kind, NAME)
    assert mirror is not None and mirror.token == version
    first, second = (
        engine_world.propose(
            kind, NAME, run=other, payload={"limit": n}, observed_version=mirror.token
        )
        for other, n in ((engine_world.run, 9), (engine_world.other_run, 11))
    )
    for action in (first, second):
        assert action.status == "pending_approval"
        _approve(api, action.pk, token, answers)
    wait_for(lambda: _status(first.pk) in FINAL and _status(second.pk) in FINAL, timeout=40)
    assert {_status(first.pk), _status(second.pk)} == {"applied", "conflict"}, worker.output()
    winner, loser = (first, second) if _status(first.pk) == "applied" else (second, first)
    seen = remote.look()
    assert seen.document == {"limit": 9 if winner is first else 11}
    assert len(seen.messages) == commits  # the winner's commit: nothing lost, nothing twice
    assert f"Airlock-Action: {winner.pk}" in seen.messages[0]
    assert not any(f"Airlock-Action: {loser.pk}" in m for m in seen.messages)
    conflict = Conflict.objects.get(action=loser, origin="write")
    assert conflict.current_version == seen.blob != mirror.token  # the winner's blob
    return winner


def _no_credential_anywhere(
    server: Server, answers: list[bytes], caplog: pytest.LogCaptureFixture, *workers: Any
) -> None:
    for worker in workers:
        worker.stop()
    events = json.dumps(list(AuditEvent.objects.values_list("details", flat=True)))
    outputs = [worker.output() for worker in workers]
    assert events != "[]" and all(outputs)  # something to look at
    places = [*(answer.decode() for answer in answers), events, *outputs]
    places += [record.getMessage() for record in caplog.records]
    for place in places:
        for secret in server.secrets:
            assert secret not in place


def test_a_remote_kind_is_governed_end_to_end_and_its_credential_shows_nowhere(
    api: Any,
    admin: Any,
    engine_world: Any,
    remote: Remote,
    rq_worker: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    answers: list[bytes] = []
    kind = _put_kind(api, admin, remote, answers)
    ana = engine_world.operator  # an operator: approves and may undo
    _, ana_token = personal_token_create(user=ana, actor=Actor.system("tests"))

    # 1. A run reads the file, proposes, ana approves, the worker pushes: one commit.
    run = _agent_run()
    action_id, done, worker = _an_approved_write_lands_once(
        api, run, ana_token, remote, rq_worker, answers
    )
    shown = api.get(f"/api/v1/actions/{action_id}", token=run.token)
    answers.append(shown.content)

    # 2. Undo: the prior content, conditionally on the version our write produced.
    undo = api.undo(action_id, token=run.token, key=f"remote-undo-{uuid.uuid4().hex}")
    answers.append(undo.content)
    assert undo.status_code == 202, undo.content
    wait_for(lambda: _status(action_id) in ("undone", "failed"), timeout=40)
    assert _status(action_id) == "undone", worker.output()
    seen = remote.look()
    assert seen.document == {"limit": 1}
    assert len(seen.messages) == 3 and f"undo of operation {done.pk}" in seen.messages[0]
    again = api.get(PATH, token=run.token)
    answers.append(again.content)
    assert again.json()["document"] == {"limit": 1}
    assert again["ETag"] == f'"{seen.blob}"'  # the restored file's blob (ours: indented)

    # 3. Two runs from that version: one commit lands, the other is a conflict.
    winner = _two_runs_from_one_version(
        api, kind, engine_world, remote, ana_token, answers, worker, version=seen.blob, commits=4
    )

    # 4. Someone else pushes a change to the same file; undoing the winner must not erase it.
    remote.someone_pushes({"limit": 40, "by": "someone"})
    undo = api.undo(winner.pk, token=ana_token, key=f"remote-undo-{uuid.uuid4().hex}")
    answers.append(undo.content)
    assert undo.status_code == 202, undo.content
    applied = Operation.objects.get(action=winner, undo_of__isnull=True, status="done")
    wait_for(
        lambda: Operation.objects.filter(undo_of=applied).exclude(status="pending").exists(),
        timeout=40,
    )
    refused = Operation.objects.get(undo_of=applied)
    assert refused.status == "failed", refused.outcome
    assert refused.outcome["reason"] == "resource_moved", refused.outcome
    seen = remote.look()
    assert seen.document == {"limit": 40, "by": "someone"}
    assert len(seen.messages) == 5  # someone's commit; none of the undo
    assert _status(winner.pk) == "applied"
    assert Conflict.objects.get(action=winner, origin="undo").status == "open"
    listed = api.get("/api/v1/conflicts?limit=50", token=ana_token)
    answers.append(listed.content)

    _no_credential_anywhere(remote.server, answers, caplog, worker)


def test_the_remote_down_backs_off_then_fails_never_a_false_applied(
    api: Any, admin: Any, operator: Any, remote: Remote, rq_worker: Any, caplog: Any
) -> None:
    caplog.set_level("DEBUG")
    answers: list[bytes] = []
    _put_kind(api, admin, remote, answers)
    run = _agent_run()
    read = api.get(PATH, token=run.token)
    answers.append(read.content)
    action_id = _propose(api, run, read["ETag"], {"limit": 2}, answers)
    _approve(api, action_id, operator.token, answers)

    remote.server.stop()  # Apache / sshd down: nothing can reach the remote
    worker = rq_worker(**FAST_RETRIES, **remote.server.credentials)
    wait_for(lambda: _status(action_id) in FINAL, timeout=60)
    assert _status(action_id) == "failed", worker.output()
    action = Action.objects.get(pk=action_id)
    assert action.error["code"] == "attempts_exhausted"
    assert str(action.error["reason"]).startswith("target_unreachable"), action.error
    attempts = list(Operation.objects.filter(action_id=action_id).order_by("started_at"))
    assert len(attempts) == 3
    assert all(str(a.outcome["refused"]).startswith("target_unreachable") for a in attempts)
    gaps = [
        (later.started_at - earlier.started_at).total_seconds()
        for earlier, later in pairwise(attempts)
    ]
    assert all(gap >= 0.1 for gap in gaps), gaps  # backed off between attempts
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action_id).exists()
    shown = api.get(f"/api/v1/actions/{action_id}", token=run.token)
    answers.append(shown.content)

    remote.server.start()
    seen = remote.look()
    assert (seen.document, len(seen.messages)) == ({"limit": 1}, 1)  # nothing reached it
    _no_credential_anywhere(remote.server, answers, caplog, worker)


@pytest.mark.parametrize("server", ["https"], indirect=True)
def test_an_https_remote_trusting_a_private_ca_is_governed_and_a_worker_without_it_sends_nothing(
    api: Any,
    admin: Any,
    engine_world: Any,
    remote: Remote,
    rq_worker: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The http remote over https (mod_ssl), its certificate from a CA the test made: the
    kind names the CA's variable (`ca_bundle_env`) beside the Basic credential's."""
    caplog.set_level("DEBUG")
    answers: list[bytes] = []
    assert remote.settings["repository"].startswith("https://")
    kind = _put_kind(api, admin, remote, answers)  # its probe read trusts the CA
    assert kind.target_settings["ca_bundle_env"] == CA_ENV  # the variable's name, not the PEM
    _, ana_token = personal_token_create(user=engine_world.operator, actor=Actor.system("tests"))

    # 1. A worker whose CA variable holds another CA (not the one that signed the server's
    # certificate): every attempt stops at the handshake — not sent — then `failed`. (It
    # runs first: a killed worker's RQ scheduler lock outlives it by a minute, and these
    # attempts are retries the scheduler enqueues.)
    before = remote.look()
    run = _agent_run()
    read = api.get(PATH, token=run.token)
    answers.append(read.content)
    action_id = _propose(api, run, read["ETag"], {"limit": 50}, answers)
    _approve(api, action_id, ana_token, answers)
    lacking = rq_worker(**{**FAST_RETRIES, **remote.server.credentials, CA_ENV: another_ca_pem()})
    wait_for(lambda: _status(action_id) in FINAL, timeout=40)
    assert _status(action_id) == "failed", lacking.output()
    assert Action.objects.get(pk=action_id).error["code"] == "attempts_exhausted"
    refusals = [str(a.outcome["refused"]) for a in Operation.objects.filter(action_id=action_id)]
    assert len(refusals) == 3, refusals
    for refused in refusals:
        assert refused.startswith("target_unreachable"), refused
        assert "TLS certificate did not verify against the CA bundle in" in refused, refused
    assert remote.look() == before  # nothing pushed: the same file, the same commits
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action_id).exists()
    lacking.stop()

    # 2. A worker trusting the CA: an approved write lands as exactly one commit; two runs
    # from one version: one more commit, the other a conflict.
    _, _, worker = _an_approved_write_lands_once(api, run, ana_token, remote, rq_worker, answers)
    version = remote.look().blob
    _two_runs_from_one_version(
        api, kind, engine_world, remote, ana_token, answers, worker, version=version, commits=3
    )
    _no_credential_anywhere(remote.server, answers, caplog, lacking, worker)


@pytest.mark.parametrize("server", ["https-mtls"], indirect=True)
def test_an_https_remote_requiring_a_client_certificate_is_governed_and_a_wrong_one_pushes_nothing(
    api: Any,
    admin: Any,
    engine_world: Any,
    remote: Remote,
    rq_worker: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The https remote behind `SSLVerifyClient require`: the kind names the client
    certificate's variable (`client_cert_env`) beside the CA's and the Basic credential's."""
    caplog.set_level("DEBUG")
    answers: list[bytes] = []
    kind = _put_kind(api, admin, remote, answers)  # its probe read presents the certificate
    assert kind.target_settings["client_cert_env"] == CLIENT_ENV  # the name, not the PEM
    _, ana_token = personal_token_create(user=engine_world.operator, actor=Actor.system("tests"))

    # 1. A worker presenting a certificate from a CA the server does not know: git's first
    # request (the refs) is refused, so nothing was pushed — not sent, then `failed`.
    before = remote.look()
    run = _agent_run()
    read = api.get(PATH, token=run.token)
    answers.append(read.content)
    action_id = _propose(api, run, read["ETag"], {"limit": 50}, answers)
    _approve(api, action_id, ana_token, answers)
    wrong = rq_worker(
        **{**FAST_RETRIES, **remote.server.credentials, CLIENT_ENV: another_client_pem()}
    )
    wait_for(lambda: _status(action_id) in FINAL, timeout=40)
    assert _status(action_id) == "failed", wrong.output()
    assert Action.objects.get(pk=action_id).error["code"] == "attempts_exhausted"
    refusals = [str(a.outcome["refused"]) for a in Operation.objects.filter(action_id=action_id)]
    assert len(refusals) == 3, refusals
    for refused in refusals:
        assert refused.startswith("target_unreachable"), refused
        assert "client certificate" in refused, refused
    assert remote.look() == before  # nothing pushed: the same file, the same commits
    assert not AuditEvent.objects.filter(event_type="write.applied", action_id=action_id).exists()
    wrong.stop()

    # 2. A worker presenting the right certificate: the approved write lands as one commit.
    _, _, worker = _an_approved_write_lands_once(api, run, ana_token, remote, rq_worker, answers)
    _no_credential_anywhere(remote.server, answers, caplog, wrong, worker)
