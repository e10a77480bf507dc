"""Targets behind TLS with a private CA (issue 39): the `http` adapter and a git https
remote against a REAL TLS server — Debian's Apache httpd with mod_ssl (tests/fixtures/dav.py,
tests/fixtures/git_http.py), its certificate issued by a CA made for the test
(tests/fixtures/tls.py), nowhere in the system's trust store.

A kind trusting that CA (`ca_bundle_env` naming the variable with its PEM) reads and writes
conditionally over https; without it, or trusting another CA, or meeting a certificate that
names another host, the server is refused at the handshake: a read raises TargetError saying
the certificate did not verify, a write is `not_sent`, and the server holds nothing new. The
PEM and the Basic credential appear in no result, error or log record. Skipped where apache2
or mod_ssl (or git's http backend) is missing, or not root."""

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

import httpx
import pytest

from engine.targets import git_ssh
from engine.targets.base import Outcome, TargetConfigError, TargetError, WriteResult
from engine.targets.git import GitSettings, GitTarget
from engine.targets.http_etag import HttpEtagSettings, HttpEtagTarget
from engine.targets.registry import adapter_for
from engine.targets.tls import default_trust, git_tls_config
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
from tests.fixtures.tls import CA_ENV, another_ca_pem, server_pki

OTHER_CA_ENV = "AIRLOCK_TEST_OTHER_CA_BUNDLE"
GIT_ENV = "AIRLOCK_TEST_GIT_CREDENTIALS"
NOT_VERIFIED = "TLS certificate did not verify"


def _key() -> str:
    return f"airlock-action-{uuid.uuid4()}"


def _pem_lines(pem: str) -> list[str]:
    return [line for line in pem.splitlines() if line and not line.startswith("-----")]


def _nothing_leaks(texts: list[str], pems: list[str], secret: str) -> None:
    for text in texts:
        assert secret not in text, text
        for pem in pems:
            for line in _pem_lines(pem):
                assert line not in text, text


# -- the http adapter over https -------------------------------------------------------------


def _http_target(dav: Dav, **extra: Any) -> HttpEtagTarget:
    settings = {"base_url": dav.url, "credentials_env": ENV, "auth_scheme": "Basic", **extra}
    return HttpEtagTarget(HttpEtagSettings.from_settings(settings))


def test_the_http_adapter_trusting_the_private_ca_reads_writes_and_refuses_a_stale_write(
    apache_tls: Dav, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    assert apache_tls.url.startswith("https://")
    target = _http_target(apache_tls, ca_bundle_env=CA_ENV)
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
    assert stale.current is not None and stale.current.document == {"n": 2}
    assert (apache_tls.root / "a.json").read_text() == '{"n":2}'
    assert apache_tls.pki is not None
    texts = [repr(created), repr(written), repr(stale), repr(target.settings), caplog.text]
    _nothing_leaks(texts, [apache_tls.pki.ca_pem], PASSWORD)


def _refused(target: HttpEtagTarget, dav: Dav, version: str) -> list[str]:
    """Read, write, create and delete are all stopped at the handshake; the texts."""
    with pytest.raises(TargetError) as raised:
        target.read("a.json")
    results: list[WriteResult] = [
        target.write("a.json", {"n": 9}, expected_version=version, fence=9, idempotency_key=_key()),
        target.create("b.json", {"n": 9}, fence=9, idempotency_key=_key()),
        target.delete("a.json", expected_version=version, fence=9, idempotency_key=_key()),
    ]
    for result in results:
        assert result.outcome is Outcome.NOT_SENT, result
        assert NOT_VERIFIED in result.detail and "nothing was sent" in result.detail
    # Nothing reached the server: the file as it was, nothing created.
    assert (dav.root / "a.json").read_text() == '{"n":1}'
    assert not (dav.root / "b.json").exists()
    return [str(raised.value), *(repr(r) for r in results)]


@pytest.mark.parametrize("trust", ["default store", "another CA"])
def test_a_server_whose_certificate_does_not_verify_is_refused_and_nothing_is_written(
    apache_tls: Dav, trust: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    version = (
        _http_target(apache_tls, ca_bundle_env=CA_ENV)
        .create("a.json", {"n": 1}, fence=1, idempotency_key=_key())
        .version
    )
    assert version is not None
    other = another_ca_pem()
    monkeypatch.setenv(OTHER_CA_ENV, other)
    target = (
        _http_target(apache_tls)
        if trust == "default store"
        else _http_target(apache_tls, ca_bundle_env=OTHER_CA_ENV)
    )
    texts = _refused(target, apache_tls, version)
    where = "the default trust store" if trust == "default store" else f"bundle in {OTHER_CA_ENV}"
    assert NOT_VERIFIED in texts[0] and where in texts[0], texts[0]
    assert apache_tls.pki is not None
    _nothing_leaks([*texts, caplog.text], [apache_tls.pki.ca_pem, other], PASSWORD)


@pytest.fixture
def fresh_default_trust() -> Iterator[None]:
    """The process's default trust built afresh for the test, and again after it (a test's
    SSL_CERT_FILE must not stay trusted for the tests that follow)."""
    default_trust.cache_clear()
    yield
    default_trust.cache_clear()


def test_the_default_trust_is_built_once_a_process_from_what_httpx_trusts(
    apache_tls: Dav, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_default_trust: None
) -> None:
    """Without ca_bundle_env the adapter trusts what httpx's `verify=True` trusts — certifi's
    bundle, or SSL_CERT_FILE's — from a context built once a process (httpx built one for
    every client: a bundle loaded for every write)."""
    assert apache_tls.pki is not None
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    certifi_trust = default_trust()
    assert default_trust() is certifi_trust  # shared, not rebuilt
    expected = httpx.create_ssl_context().cert_store_stats()
    assert certifi_trust.cert_store_stats() == expected
    # The private CA is not in certifi's bundle: refused at the handshake, nothing written.
    refused = _http_target(apache_tls).create("d.json", {"n": 1}, fence=1, idempotency_key=_key())
    assert refused.outcome is Outcome.NOT_SENT and NOT_VERIFIED in (refused.detail or "")
    assert not (apache_tls.root / "d.json").exists()
    # A process started with SSL_CERT_FILE naming the private CA trusts it, as httpx does.
    bundle = tmp_path / "ca.pem"
    bundle.write_text(apache_tls.pki.ca_pem)
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    default_trust.cache_clear()  # what a new process would build
    assert default_trust() is not certifi_trust
    created = _http_target(apache_tls).create("d.json", {"n": 1}, fence=1, idempotency_key=_key())
    assert created.applied, created
    assert (apache_tls.root / "d.json").read_text() == '{"n":1}'
    # trust_env off (the webhook's client) ignores the variable, as httpx does.
    assert default_trust(trust_env=False).cert_store_stats() == expected


def test_a_certificate_from_the_trusted_ca_naming_another_host_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not HAVE_APACHE_TLS:
        pytest.skip(TLS_SKIP_REASON)
    server = apache_server(server_pki(host="elsewhere.internal"))
    with contextmanager(running)(server, monkeypatch) as dav:
        (dav.root / "a.json").write_text('{"n":1}')
        with pytest.raises(TargetError) as raised:
            _http_target(dav, ca_bundle_env=CA_ENV).read("a.json")
        assert NOT_VERIFIED in str(raised.value)
        assert "Hostname mismatch" in str(raised.value) or "IP address" in str(raised.value)


def test_a_ca_variable_unset_or_not_pem_sends_nothing(
    apache_tls: Dav, monkeypatch: pytest.MonkeyPatch
) -> None:
    (apache_tls.root / "a.json").write_text('{"n":1}')
    target = _http_target(apache_tls, ca_bundle_env=OTHER_CA_ENV)
    for value, said in ((None, "is not set"), ("not a certificate", "not PEM certificate text")):
        if value is None:
            monkeypatch.delenv(OTHER_CA_ENV, raising=False)
        else:
            monkeypatch.setenv(OTHER_CA_ENV, value)
        with pytest.raises(TargetError, match=said):
            target.read("a.json")
        result = target.write(
            "a.json", {"n": 2}, expected_version="x", fence=1, idempotency_key=_key()
        )
        assert result.outcome is Outcome.NOT_SENT and said in result.detail, result
    assert (apache_tls.root / "a.json").read_text() == '{"n":1}'


# -- a git https remote ----------------------------------------------------------------------


@pytest.fixture
def https_remote(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[str, Path, str]]:
    """(URL, served bare repository, the CA's PEM): git-http-backend behind Apache over
    https with Basic auth; the credentials and the CA in their variables; the CA file's
    scratch folder is tmp_path/scratch (to see it is emptied)."""
    if not HAVE_GIT_HTTPS:
        pytest.skip(HTTPS_SKIP_REASON)
    pki = server_pki()
    monkeypatch.setenv(GIT_ENV, f"{GIT_USER}:{GIT_PASSWORD}")
    monkeypatch.setenv(CA_ENV, pki.ca_pem)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(git_ssh, "SCRATCH", str(scratch))
    with served_repository(pki) as (url, served, _server):
        yield url, served, pki.ca_pem


def _git_target(url: str, mirror: Path, **extra: Any) -> GitTarget:
    settings = {"repository": url, "mirror": str(mirror), "credentials_env": GIT_ENV, **extra}
    return GitTarget(GitSettings.from_settings(settings))


def _commits(served: Path) -> list[str]:
    done = subprocess.run(
        ["git", "--git-dir", str(served), "log", "--format=%s", "main"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.splitlines() if done.returncode == 0 else []


def test_a_git_https_remote_trusting_the_private_ca_takes_a_write_once(
    https_remote: tuple[str, Path, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url, served, ca_pem = https_remote
    assert url.startswith("https://")
    target = _git_target(url, tmp_path / "mirror.git", ca_bundle_env=CA_ENV)
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
    assert list((tmp_path / "scratch").iterdir()) == []  # the CA file removed after each call
    texts = [repr(created), repr(written), repr(stale), repr(target.settings), caplog.text]
    _nothing_leaks(texts, [ca_pem], GIT_PASSWORD)


@pytest.mark.parametrize("trust", ["default store", "another CA"])
def test_a_git_https_remote_whose_certificate_does_not_verify_gets_nothing(
    https_remote: tuple[str, Path, str],
    trust: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url, served, ca_pem = https_remote
    trusting = _git_target(url, tmp_path / "mirror.git", ca_bundle_env=CA_ENV)
    version = trusting.create("a.json", {"a": 1}, fence=1, idempotency_key=_key()).version
    assert version is not None
    other = another_ca_pem()
    monkeypatch.setenv(OTHER_CA_ENV, other)
    extra = {} if trust == "default store" else {"ca_bundle_env": OTHER_CA_ENV}
    target = _git_target(url, tmp_path / "other-mirror.git", **extra)
    with pytest.raises(TargetError) as raised:
        target.read("a.json")
    assert NOT_VERIFIED in str(raised.value), raised.value
    results = [
        target.write("a.json", {"a": 9}, expected_version=version, fence=9, idempotency_key=_key()),
        target.create("b.json", {"b": 9}, fence=9, idempotency_key=_key()),
    ]
    for result in results:
        assert result.outcome is Outcome.NOT_SENT and NOT_VERIFIED in result.detail, result
    assert _commits(served) == ["airlock: create a.json"]  # nothing pushed
    texts = [str(raised.value), *(repr(r) for r in results), caplog.text]
    _nothing_leaks(texts, [ca_pem, other], GIT_PASSWORD)


def test_a_git_https_remote_whose_certificate_names_another_host_gets_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not HAVE_GIT_HTTPS:
        pytest.skip(HTTPS_SKIP_REASON)
    pki = server_pki(host="elsewhere.internal")  # the trusted CA's, for another name
    monkeypatch.setenv(GIT_ENV, f"{GIT_USER}:{GIT_PASSWORD}")
    monkeypatch.setenv(CA_ENV, pki.ca_pem)
    with served_repository(pki) as (url, served, _server):
        target = _git_target(url, tmp_path / "mirror.git", ca_bundle_env=CA_ENV)
        created = target.create("a.json", {"a": 1}, fence=1, idempotency_key=_key())
        assert created.outcome is Outcome.NOT_SENT and NOT_VERIFIED in created.detail, created
        assert _commits(served) == []


def test_a_git_https_push_meeting_a_certificate_that_stopped_verifying_is_not_sent(
    https_remote: tuple[str, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetch verified, then the push's handshake did not (the bundle changed between
    them): nothing was sent — `not_sent`, not an unknown outcome to settle."""
    url, served, _ = https_remote
    target = _git_target(url, tmp_path / "mirror.git", ca_bundle_env=CA_ENV)
    version = target.create("a.json", {"a": 1}, fence=1, idempotency_key=_key()).version
    assert version is not None
    remote = target._remote
    assert remote is not None
    push = remote.push

    def push_after_the_bundle_changed(commit: str, head: str | None) -> str:
        monkeypatch.setenv(CA_ENV, another_ca_pem())
        return push(commit, head)

    monkeypatch.setattr(remote, "push", push_after_the_bundle_changed)
    result = target.write(
        "a.json", {"a": 2}, expected_version=version, fence=2, idempotency_key=_key()
    )
    assert result.outcome is Outcome.NOT_SENT and NOT_VERIFIED in result.detail, result
    assert "git push failed" in result.detail
    assert _commits(served) == ["airlock: create a.json"]


def test_a_git_ca_variable_that_is_unset_sends_nothing(
    https_remote: tuple[str, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, served, _ = https_remote
    monkeypatch.delenv(OTHER_CA_ENV, raising=False)
    target = _git_target(url, tmp_path / "mirror.git", ca_bundle_env=OTHER_CA_ENV)
    with pytest.raises(TargetError, match="is not set"):
        target.read("a.json")
    created = target.create("a.json", {"a": 1}, fence=1, idempotency_key=_key())
    assert created.outcome is Outcome.NOT_SENT and "is not set" in created.detail, created
    assert _commits(served) == []


def test_a_worker_gitconfig_or_variable_turning_verification_off_changes_nothing(
    https_remote: tuple[str, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's own ~/.gitconfig says sslVerify = false (in general and for exactly
    this URL) and GIT_SSL_NO_VERIFY is set: the adapter still verifies."""
    url, served, _ = https_remote
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        f'[http]\n\tsslVerify = false\n[http "{url}"]\n\tsslVerify = false\n'
    )
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_SSL_NO_VERIFY", "1")
    target = _git_target(url, tmp_path / "mirror.git")  # no CA setting: the default trust
    with pytest.raises(TargetError, match=NOT_VERIFIED):
        target.read("a.json")
    created = target.create("a.json", {"a": 1}, fence=1, idempotency_key=_key())
    assert created.outcome is Outcome.NOT_SENT and NOT_VERIFIED in created.detail, created
    assert _commits(served) == []


def test_the_git_ca_file_is_private_while_git_runs_and_gone_after(tmp_path: Path) -> None:
    url = "https://git.internal/a=b/config.git"  # "=" would break a `-c key=value`
    with git_tls_config(url, "PEM TEXT\n", str(tmp_path)) as env:
        bundle = Path(env["GIT_CONFIG_VALUE_1"])
        assert env == {
            "GIT_CONFIG_COUNT": "3",
            "GIT_CONFIG_KEY_0": f"http.{url}.sslVerify",
            "GIT_CONFIG_VALUE_0": "true",
            "GIT_CONFIG_KEY_1": f"http.{url}.sslCAInfo",
            "GIT_CONFIG_VALUE_1": str(bundle),
            "GIT_CONFIG_KEY_2": f"http.{url}.sslCAPath",
            "GIT_CONFIG_VALUE_2": str(bundle.parent),
        }
        assert bundle.read_text() == "PEM TEXT\n" and bundle.parent.parent == tmp_path
        assert stat.S_IMODE(os.stat(bundle).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(bundle.parent).st_mode) == 0o700
        shown = subprocess.run(
            ["git", "config", "--get-urlmatch", "http.sslCAInfo", url],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        assert shown.stdout.strip() == str(bundle)  # git reads it for exactly this URL
    assert not bundle.exists() and list(tmp_path.iterdir()) == []
    with git_tls_config(url, None, str(tmp_path)) as env:
        assert env["GIT_CONFIG_KEY_0"] == f"http.{url}.sslVerify"  # on, always
        assert env["GIT_CONFIG_VALUE_0"] == "true" and env["GIT_CONFIG_COUNT"] == "1"


# -- the settings rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "settings", "message"),
    [
        ("http_etag", {"base_url": "https://h/x", "ca_bundle_env": "-----BEGIN"}, "ca_bundle_env:"),
        ("http_etag", {"base_url": "https://h/x", "ca_bundle_env": 3}, "ca_bundle_env:"),
        ("http_etag", {"base_url": "http://h/x", "ca_bundle_env": "CA"}, "only for an https"),
        ("http_etag", {"base_url": "https://h/x", "ca_verify": False}, "unknown setting"),
        (
            "git",
            {"repository": "https://h/r.git", "mirror": "/m", "ca_bundle_env": "A B"},
            "ca_bundle_env:",
        ),
        (
            "git",
            {"repository": "http://h/r.git", "mirror": "/m", "ca_bundle_env": "CA"},
            "ca_bundle_env: only for https remotes",
        ),
        (
            "git",
            {"repository": "ssh://git@h/r.git", "mirror": "/m", "ca_bundle_env": "CA"},
            "ca_bundle_env: only for https remotes",
        ),
        ("git", {"repository": "/r", "ca_bundle_env": "CA"}, "only for a remote"),
        (
            "git",
            {"repository": "https://h/r.git", "mirror": "/m", "ssl_verify": False},
            "unknown setting",
        ),
    ],
)
def test_ca_settings_are_checked_and_nothing_turns_verification_off(
    target: str, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(TargetConfigError, match=message):
        adapter_for(target, settings)


def test_good_ca_settings_are_kept_as_names() -> None:
    http = adapter_for("http_etag", {"base_url": "https://h/x", "ca_bundle_env": "CA"})
    git = adapter_for(
        "git", {"repository": "https://h/r.git", "mirror": "/m", "ca_bundle_env": "CA"}
    )
    assert isinstance(http, HttpEtagTarget) and http.settings.ca_bundle_env == "CA"
    assert isinstance(git, GitTarget) and git.settings.ca_bundle_env == "CA"
