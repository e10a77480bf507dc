"""Targets behind mutual TLS (issue 39): the `http` adapter and a git https remote against a
REAL server that requires a client certificate — Debian's Apache httpd with mod_ssl and
`SSLVerifyClient require` (tests/fixtures/dav.py `apache_mtls`, tests/fixtures/git_http.py),
the server's and the client's certificates issued by a CA made for the test
(tests/fixtures/tls.py).

A kind naming the variable with the client certificate and its key (`client_cert_env`) reads
and writes conditionally; without it, or with a certificate from another CA, the server
refuses the TLS session and nothing is applied. What that outcome is depends on when the
refusal is seen: Apache speaks TLS 1.3, whose alert arrives after httpx has written the
request — the http adapter's write is `unknown` (it cannot prove the request was not taken:
settle by reading); with TLS 1.2 the alert ends the handshake — `not_sent`. git asks for the
refs (a GET) before it pushes anything, so a refusal there is `not_sent`. The key's text
appears in no result, error or log record, and its scratch file is gone after each call.
Skipped where apache2 or mod_ssl (or git's http backend) is missing, or not root."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.targets import git_ssh, http_etag
from engine.targets.base import Outcome, TargetConfigError, TargetError
from engine.targets.git import GitSettings, GitTarget
from engine.targets.http_etag import HttpEtagSettings, HttpEtagTarget
from engine.targets.registry import adapter_for
from engine.targets.tls import git_tls_config
from tests.fixtures.dav import (
    ENV,
    HAVE_APACHE_TLS,
    PASSWORD,
    TLS_SKIP_REASON,
    Dav,
    apache_server,
    running,
)
from tests.fixtures.git_http import HAVE_GIT_HTTPS, HTTPS_SKIP_REASON, served_repository
from tests.fixtures.git_http import PASSWORD as GIT_PASSWORD
from tests.fixtures.git_http import USER as GIT_USER
from tests.fixtures.tls import CA_ENV, CLIENT_ENV, Pki, another_client_pem, server_pki

OTHER_CLIENT_ENV = "AIRLOCK_TEST_OTHER_CLIENT_CERT"
GIT_ENV = "AIRLOCK_TEST_GIT_CREDENTIALS"
REFUSED = "the server refused"
ENDED = "the server ended the TLS session at git's first request"
WITHOUT = "a connection without a client certificate"


def _key() -> str:
    return f"airlock-action-{uuid.uuid4()}"


def _pem_lines(pem: str) -> list[str]:
    return [line for line in pem.splitlines() if line and not line.startswith("-----")]


def _nothing_leaks(texts: list[str], keys: list[str], secret: str) -> None:
    """No line of a private key (nor the Basic password) in any of `texts`."""
    for text in texts:
        assert secret not in text, text
        for key in keys:
            for line in _pem_lines(key):
                assert line not in text, text


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the client certificate's private file is made (both adapters): to see it go."""
    where = tmp_path / "scratch"
    where.mkdir()
    monkeypatch.setattr(http_etag, "SCRATCH", str(where))
    monkeypatch.setattr(git_ssh, "SCRATCH", str(where))
    return where


# -- the http adapter ------------------------------------------------------------------------


def _http_target(dav: Dav, **extra: Any) -> HttpEtagTarget:
    settings = {
        "base_url": dav.url,
        "credentials_env": ENV,
        "auth_scheme": "Basic",
        "ca_bundle_env": CA_ENV,
        **extra,
    }
    return HttpEtagTarget(HttpEtagSettings.from_settings(settings))


def _pki(dav: Dav) -> Pki:
    assert dav.pki is not None
    return dav.pki


def test_the_http_adapter_presenting_its_client_certificate_reads_and_writes_conditionally(
    apache_mtls: Dav, scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    target = _http_target(apache_mtls, client_cert_env=CLIENT_ENV)
    created = target.create("a.json", {"n": 1}, fence=1, idempotency_key=_key())
    assert created.applied and created.version, created
    seen = target.read("a.json")
    assert seen.document == {"n": 1} and seen.version == created.version
    written = target.write(
        "a.json", {"n": 2}, expected_version=created.version, fence=2, idempotency_key=_key()
    )
    assert written.applied and written.version not in (None, created.version), written
    stale = target.write(
        "a.json", {"n": 3}, expected_version=created.version, fence=3, idempotency_key=_key()
    )
    assert stale.outcome is Outcome.STALE, stale
    assert (apache_mtls.root / "a.json").read_text() == '{"n":2}'
    assert list(scratch.iterdir()) == []  # the key's file removed after each call
    texts = [repr(created), repr(written), repr(stale), repr(target.settings), caplog.text]
    _nothing_leaks(texts, [_pki(apache_mtls).client_key_pem], PASSWORD)


@pytest.mark.parametrize("presented", ["no certificate", "another CA's"])
def test_a_write_the_server_refuses_for_its_client_certificate_is_unknown_and_not_applied(
    apache_mtls: Dav,
    presented: str,
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TLS 1.3 (Apache's default): the refusal is read after the request was written. The
    write is `unknown` — settled by reading, never called not sent — and the service did
    not take it: the file is as it was, nothing created."""
    caplog.set_level(logging.DEBUG)
    right = _http_target(apache_mtls, client_cert_env=CLIENT_ENV)
    version = right.create("a.json", {"n": 1}, fence=1, idempotency_key=_key()).version
    assert version is not None
    other = another_client_pem()
    monkeypatch.setenv(OTHER_CLIENT_ENV, other)
    extra = {} if presented == "no certificate" else {"client_cert_env": OTHER_CLIENT_ENV}
    target = _http_target(apache_mtls, **extra)
    with pytest.raises(TargetError) as raised:
        target.read("a.json")
    results = [
        target.write("a.json", {"n": 9}, expected_version=version, fence=9, idempotency_key=_key()),
        target.create("b.json", {"n": 9}, fence=9, idempotency_key=_key()),
        target.delete("a.json", expected_version=version, fence=9, idempotency_key=_key()),
    ]
    said = WITHOUT if presented == "no certificate" else f"certificate in {OTHER_CLIENT_ENV}"
    alert = "certificate required" if presented == "no certificate" else "unknown ca"
    assert REFUSED in str(raised.value) and said in str(raised.value), raised.value
    for result in results:
        assert result.outcome is Outcome.UNKNOWN, result
        assert REFUSED in result.detail and said in result.detail and alert in result.detail
        assert "after the request was written (TLS 1.3)" in result.detail, result.detail
    # Settled by reading with the right certificate: none of them was applied.
    assert right.read("a.json").document == {"n": 1} and right.read("a.json").version == version
    assert (apache_mtls.root / "a.json").read_text() == '{"n":1}'
    assert not (apache_mtls.root / "b.json").exists()
    assert list(scratch.iterdir()) == []
    texts = [str(raised.value), *(repr(r) for r in results), caplog.text]
    _nothing_leaks(texts, [_pki(apache_mtls).client_key_pem, other], PASSWORD)


def test_with_tls_1_2_the_refusal_ends_the_handshake_and_the_write_is_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not HAVE_APACHE_TLS:
        pytest.skip(TLS_SKIP_REASON)
    server = apache_server(server_pki(), verify_clients=True)
    with (server.scratch[0] / "httpd.conf").open("a") as conf:
        conf.write("SSLProtocol -all +TLSv1.2\n")  # a server that speaks TLS 1.2 only
    with contextmanager(running)(server, monkeypatch) as dav:
        (dav.root / "a.json").write_text('{"n":1}')
        os.utime(dav.root / "a.json", (1, 1))  # not changed within the last second: strong
        right = _http_target(dav, client_cert_env=CLIENT_ENV)
        version = right.read("a.json").version  # the right certificate works over TLS 1.2
        assert version is not None
        target = _http_target(dav)
        with pytest.raises(TargetError, match=REFUSED):
            target.read("a.json")
        result = target.write(
            "a.json", {"n": 2}, expected_version=version, fence=2, idempotency_key=_key()
        )
        assert result.outcome is Outcome.NOT_SENT, result
        assert WITHOUT in result.detail and "in the handshake: nothing was sent" in result.detail
        assert (dav.root / "a.json").read_text() == '{"n":1}'


def test_a_client_certificate_variable_unset_or_not_a_certificate_and_key_sends_nothing(
    apache_mtls: Dav, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (apache_mtls.root / "a.json").write_text('{"n":1}')
    pki = _pki(apache_mtls)
    certificate_only = pki.client_pem.replace(pki.client_key_pem, "")
    target = _http_target(apache_mtls, client_cert_env=OTHER_CLIENT_ENV)
    for value, said in (
        (None, "is not set"),
        (certificate_only, "is not a PEM certificate and its own unencrypted private key"),
        (pki.client_key_pem, "is not a PEM certificate and its own unencrypted private key"),
        (certificate_only + another_client_pem().split("-----END CERTIFICATE-----\n")[1], "own"),
    ):
        if value is None:
            monkeypatch.delenv(OTHER_CLIENT_ENV, raising=False)
        else:
            monkeypatch.setenv(OTHER_CLIENT_ENV, value)
        with pytest.raises(TargetError, match=said) as raised:
            target.read("a.json")
        result = target.write(
            "a.json", {"n": 2}, expected_version="x", fence=1, idempotency_key=_key()
        )
        assert result.outcome is Outcome.NOT_SENT and said in result.detail, result
        _nothing_leaks([str(raised.value), repr(result)], [pki.client_key_pem], PASSWORD)
        assert list(scratch.iterdir()) == []
    assert (apache_mtls.root / "a.json").read_text() == '{"n":1}'


# -- a git https remote ----------------------------------------------------------------------


@pytest.fixture
def mtls_remote(monkeypatch: pytest.MonkeyPatch, scratch: Path) -> Iterator[tuple[str, Path, Pki]]:
    """(URL, served bare repository, the Pki): git-http-backend behind Apache over https,
    Basic auth and a client certificate required; the credentials, the CA and the client
    certificate in their variables."""
    if not HAVE_GIT_HTTPS:
        pytest.skip(HTTPS_SKIP_REASON)
    pki = server_pki()
    monkeypatch.setenv(GIT_ENV, f"{GIT_USER}:{GIT_PASSWORD}")
    monkeypatch.setenv(CA_ENV, pki.ca_pem)
    monkeypatch.setenv(CLIENT_ENV, pki.client_pem)
    with served_repository(pki, verify_clients=True) as (url, served, _server):
        yield url, served, pki


def _git_target(url: str, mirror: Path, **extra: Any) -> GitTarget:
    settings = {
        "repository": url,
        "mirror": str(mirror),
        "credentials_env": GIT_ENV,
        "ca_bundle_env": CA_ENV,
        **extra,
    }
    return GitTarget(GitSettings.from_settings(settings))


def _commits(served: Path) -> list[str]:
    done = subprocess.run(
        ["git", "--git-dir", str(served), "log", "--format=%s", "main"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.splitlines() if done.returncode == 0 else []


def test_a_git_remote_requiring_a_client_certificate_takes_a_write_once_with_it(
    mtls_remote: tuple[str, Path, Pki],
    tmp_path: Path,
    scratch: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url, served, pki = mtls_remote
    target = _git_target(url, tmp_path / "mirror.git", client_cert_env=CLIENT_ENV)
    created = target.create("a.json", {"a": 1}, fence=1, idempotency_key=_key())
    assert created.applied and created.version is not None, created
    written = target.write(
        "a.json", {"a": 2}, expected_version=created.version, fence=2, idempotency_key=_key()
    )
    stale = target.write(
        "a.json", {"a": 3}, expected_version=created.version, fence=3, idempotency_key=_key()
    )
    assert written.applied and stale.outcome is Outcome.STALE, (written, stale)
    assert target.read("a.json").document == {"a": 2}
    assert _commits(served) == ["airlock: update a.json", "airlock: create a.json"]
    assert list(scratch.iterdir()) == []  # the CA's and the key's files removed after each
    texts = [repr(created), repr(written), repr(stale), repr(target.settings), caplog.text]
    _nothing_leaks(texts, [pki.client_key_pem], GIT_PASSWORD)


@pytest.mark.parametrize("presented", ["no certificate", "another CA's"])
def test_a_git_remote_refusing_the_client_certificate_gets_nothing_pushed(
    mtls_remote: tuple[str, Path, Pki],
    presented: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url, served, pki = mtls_remote
    right = _git_target(url, tmp_path / "mirror.git", client_cert_env=CLIENT_ENV)
    version = right.create("a.json", {"a": 1}, fence=1, idempotency_key=_key()).version
    assert version is not None
    other = another_client_pem()
    monkeypatch.setenv(OTHER_CLIENT_ENV, other)
    extra = {} if presented == "no certificate" else {"client_cert_env": OTHER_CLIENT_ENV}
    target = _git_target(url, tmp_path / "other-mirror.git", **extra)
    said = WITHOUT if presented == "no certificate" else f"certificate in {OTHER_CLIENT_ENV}"
    with pytest.raises(TargetError) as raised:
        target.read("a.json")
    assert ENDED in str(raised.value) and said in str(raised.value), raised.value
    results = [
        target.write("a.json", {"a": 9}, expected_version=version, fence=9, idempotency_key=_key()),
        target.create("b.json", {"b": 9}, fence=9, idempotency_key=_key()),
    ]
    for result in results:
        assert result.outcome is Outcome.NOT_SENT and said in result.detail, result
        assert "nothing was sent" in result.detail
    assert _commits(served) == ["airlock: create a.json"]  # nothing pushed
    texts = [str(raised.value), *(repr(r) for r in results), caplog.text]
    _nothing_leaks(texts, [pki.client_key_pem, other], GIT_PASSWORD)


def test_a_git_push_whose_client_certificate_is_refused_at_the_refs_is_not_sent(
    mtls_remote: tuple[str, Path, Pki], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetch presented the right certificate, then the push another CA's (the variable
    changed between them): git's first request of the push — the refs, a GET — is refused,
    so no pack was posted: `not_sent`, not an unknown outcome to settle."""
    url, served, _ = mtls_remote
    target = _git_target(url, tmp_path / "mirror.git", client_cert_env=CLIENT_ENV)
    version = target.create("a.json", {"a": 1}, fence=1, idempotency_key=_key()).version
    assert version is not None
    remote = target._remote
    assert remote is not None
    push = remote.push

    def push_after_the_certificate_changed(commit: str, head: str | None) -> str:
        monkeypatch.setenv(CLIENT_ENV, another_client_pem())
        return push(commit, head)

    monkeypatch.setattr(remote, "push", push_after_the_certificate_changed)
    result = target.write(
        "a.json", {"a": 2}, expected_version=version, fence=2, idempotency_key=_key()
    )
    assert result.outcome is Outcome.NOT_SENT, result
    assert "git push failed" in result.detail and ENDED in result.detail
    assert "nothing was sent" in result.detail
    assert _commits(served) == ["airlock: create a.json"]


def test_a_git_client_certificate_that_does_not_load_sends_nothing(
    mtls_remote: tuple[str, Path, Pki], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, served, pki = mtls_remote
    monkeypatch.setenv(OTHER_CLIENT_ENV, pki.client_key_pem)  # a key, no certificate
    target = _git_target(url, tmp_path / "mirror.git", client_cert_env=OTHER_CLIENT_ENV)
    with pytest.raises(TargetError, match="is not a PEM certificate and its own") as raised:
        target.read("a.json")
    created = target.create("a.json", {"a": 1}, fence=1, idempotency_key=_key())
    assert created.outcome is Outcome.NOT_SENT and "not a PEM certificate" in created.detail
    assert _commits(served) == []
    _nothing_leaks([str(raised.value), repr(created)], [pki.client_key_pem], GIT_PASSWORD)


def test_the_git_client_certificate_file_is_private_apart_from_the_ca_path_and_gone_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = server_pki()
    monkeypatch.setenv(CLIENT_ENV, pki.client_pem)
    url = "https://git.internal/a=b/config.git"
    with git_tls_config(url, pki.ca_pem, str(tmp_path), client_cert_env=CLIENT_ENV) as env:
        keys = {env[f"GIT_CONFIG_KEY_{i}"]: env[f"GIT_CONFIG_VALUE_{i}"] for i in range(5)}
        assert env["GIT_CONFIG_COUNT"] == "5"
        identity = Path(keys[f"http.{url}.sslCert"])
        assert keys[f"http.{url}.sslKey"] == str(identity)
        assert identity.read_text() == pki.client_pem
        assert stat.S_IMODE(os.stat(identity).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(identity.parent).st_mode) == 0o700
        # Not in the folder curl reads as its CA path: nothing there but the CA.
        assert identity.parent != Path(keys[f"http.{url}.sslCAPath"])
        assert [p.name for p in Path(keys[f"http.{url}.sslCAPath"]).iterdir()] == ["ca.pem"]
        shown = subprocess.run(
            ["git", "config", "--get-urlmatch", "http.sslKey", url],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        assert shown.stdout.strip() == str(identity)  # git reads it for exactly this URL
    assert not identity.exists() and list(tmp_path.iterdir()) == []


# -- the settings rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "settings", "message"),
    [
        (
            "http_etag",
            {"base_url": "https://h/x", "client_cert_env": "-----BEGIN CERTIFICATE-----"},
            "client_cert_env: the name of an environment variable",
        ),
        ("http_etag", {"base_url": "https://h/x", "client_cert_env": 3}, "client_cert_env:"),
        (
            "http_etag",
            {"base_url": "http://h/x", "client_cert_env": "CERT"},
            "client_cert_env: only for an https base_url",
        ),
        (
            "git",
            {"repository": "https://h/r.git", "mirror": "/m", "client_cert_env": "A B"},
            "client_cert_env: the name of an environment variable",
        ),
        (
            "git",
            {"repository": "http://h/r.git", "mirror": "/m", "client_cert_env": "CERT"},
            "client_cert_env: only for https remotes",
        ),
        (
            "git",
            {"repository": "ssh://git@h/r.git", "mirror": "/m", "client_cert_env": "CERT"},
            "client_cert_env: only for https remotes",
        ),
        (
            "git",
            {"repository": "file:///srv/r.git", "mirror": "/m", "client_cert_env": "CERT"},
            "client_cert_env: only for https remotes",
        ),
        ("git", {"repository": "/r", "client_cert_env": "CERT"}, "only for a remote"),
    ],
)
def test_client_certificate_settings_are_checked(
    target: str, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(TargetConfigError, match=message):
        adapter_for(target, settings)


def test_good_client_certificate_settings_are_kept_as_names() -> None:
    http = adapter_for("http_etag", {"base_url": "https://h/x", "client_cert_env": "CERT"})
    git = adapter_for(
        "git", {"repository": "https://h/r.git", "mirror": "/m", "client_cert_env": "CERT"}
    )
    assert isinstance(http, HttpEtagTarget) and http.settings.client_cert_env == "CERT"
    assert isinstance(git, GitTarget) and git.settings.client_cert_env == "CERT"
