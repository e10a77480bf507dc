"""Trusting a private certificate authority on the https targets (issue 39): the `http` kind
(httpx) and a git kind's https remote (git's curl).

A kind names `ca_bundle_env`: the environment variable holding the PEM text of the CA
certificate(s) to trust — a name, never the text, like every other setting that reaches
outside (the worker's environment is where deployment values live). It is read at each call
and kept nowhere. With it, **only** that bundle is trusted for the kind (a company's CA pins
its services; add public roots to the bundle if a chain needs them); without it, the default
trust is used as before (httpx: certifi's bundle or SSL_CERT_FILE; git: curl's system store).

Verification is never off: there is no setting for it, httpx gets an SSLContext that
verifies, and git gets `http.<the remote's URL>.sslVerify=true` (command scope, as `-c`) on
every fetch and push of an https remote (so a worker's own `sslVerify = false` in its
gitconfig, general or for that URL, does not apply; GIT_SSL_* variables never reach git:
the adapter drops GIT_* from its child's environment).

A certificate that does not verify means nothing reached the target (the handshake stopped
before a request was sent): a read raises TargetError saying so, a write is `not_sent`.

Client certificates (mutual TLS): a kind names `client_cert_env`, the variable holding the
PEM text of the client certificate (and any intermediates) followed by its unencrypted private
key — one variable, so that a certificate and a key from different rotations can never be
half-deployed, and one file is all httpx and curl need. Read at each call, written to a
private file (0600 in a fresh 0700 directory, in memory when /dev/shm is there) that exists
only while it is loaded (httpx: `load_cert_chain`, then removed at once) or while git runs
(`http.<url>.sslCert` / `sslKey`), checked to load as a certificate with its key before
anything is sent. A server that refuses the certificate (or its absence) does so with a TLS
alert: with TLS 1.2 inside the handshake — nothing was sent; with TLS 1.3 after the client's
side of the handshake, so httpx has written the request by the time it reads the alert —
the adapter cannot prove the request was not taken, and says so (`unknown`, settle by
reading). git asks for the refs (a GET) before it sends any pack, so a refusal met there is
proof that nothing was pushed.

The default trust itself (`default_trust`) is built once a process: httpx's `verify=True`
loads certifi's bundle into a new SSLContext for every client — about 8 ms of a worker's
CPU for each write to an http target and each webhook delivery, more than the request. A
context is safe to share between clients once built (nothing here changes the default one;
a kind's client certificate is loaded into a context of its own). A changed bundle file
(SSL_CERT_FILE) is read again when the process restarts, as by any long-lived client.
"""

from __future__ import annotations

import functools
import re
import ssl
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from engine.targets.base import (
    TargetConfigError,
    TargetError,
    check_env_name,
    read_credentials,
    write_private_file,
)

# What git's curl says (GnuTLS build — Debian's — or OpenSSL build) when the server's
# certificate did not verify: its chain, its validity or its name.
_CURL_CERTIFICATE = (
    "server certificate verification failed",
    "SSL certificate problem",
    "certificate verify failed",
    "does not match target host name",
    "no alternative certificate subject name",
    "SSL peer certificate or SSH remote key was not OK",
)
# GnuTLS' curl names the CA file it used: here a scratch file already removed — noise.
_CURL_CA_FILES = re.compile(r"\s*CAfile: \S+ CRLfile: \S+")
# The alerts (OpenSSL's names) a server refuses a client certificate, or its absence, with:
# none presented (TLS 1.3: certificate required; TLS 1.2: handshake failure), a CA it does
# not know, one expired, revoked or otherwise refused.
_CLIENT_CERTIFICATE_ALERTS = (
    "CERTIFICATE_REQUIRED",
    "HANDSHAKE_FAILURE",
    "UNKNOWN_CA",
    "BAD_CERTIFICATE",
    "UNSUPPORTED_CERTIFICATE",
    "CERTIFICATE_EXPIRED",
    "CERTIFICATE_REVOKED",
    "CERTIFICATE_UNKNOWN",
    "ACCESS_DENIED",
)
# How git's curl reports a server ending the TLS session at once: an alert (GnuTLS, Debian's
# git, names none; an OpenSSL build does), or — when the server's close wins the race with
# curl's next call, about 2 times in 5 against Apache — the socket already shut.
_CURL_SESSION_ENDED = (
    "A TLS fatal alert has been received",
    "alert certificate required",
    "alert handshake failure",
    "alert unknown ca",
    "alert bad certificate",
    "alert certificate expired",
    "alert certificate revoked",
    "alert certificate unknown",
    "alert access denied",
    "Transport endpoint is not connected",
    "Broken pipe",
    "Connection reset by peer",
)
# git's line for its first request (the refs, a GET) failing: nothing else was sent.
_CURL_DISCOVERY = re.compile(r"^fatal: unable to access '[^']*': (?P<reason>.+)$")


def tls_setting(settings: Mapping[str, Any], name: str, *, https: bool, refusal: str) -> str | None:
    """A TLS setting (`ca_bundle_env`, `client_cert_env`): the name of a variable, and only
    where the target speaks https — else TargetConfigError `<name>: <refusal>`."""
    value = settings.get(name)
    if value is None:
        return None
    check_env_name(value, name)
    if not https:
        raise TargetConfigError(f"{name}: {refusal}")
    return str(value)


@contextmanager
def private_pem_file(pem: str, name: str, scratch: str | None) -> Iterator[Path]:
    """`pem` in a file `name` (0600) of a fresh 0700 directory in `scratch` (memory when
    that is /dev/shm) that exists only inside the block."""
    with tempfile.TemporaryDirectory(prefix="airlock-tls-", dir=scratch) as folder:
        yield write_private_file(Path(folder) / name, pem)


def _load_client_certificate(context: ssl.SSLContext, path: Path, env_name: str) -> None:
    def no_passphrase() -> bytes:
        # An encrypted key: refused here rather than OpenSSL asking on a terminal.
        raise TargetError("encrypted")

    try:
        context.load_cert_chain(path, password=no_passphrase)
    except (ssl.SSLError, TargetError, ValueError):
        raise TargetError(
            f"the client certificate in {env_name} is not a PEM certificate and its "
            "own unencrypted private key"
        ) from None


def present_client_certificate(context: ssl.SSLContext, env_name: str, scratch: str | None) -> None:
    """Load the certificate and key in `env_name` into `context` (httpx): through a private
    file removed as soon as they are loaded. TargetError when the variable is unset or its
    text does not load (never echoed)."""
    with private_pem_file(read_credentials(env_name), "client.pem", scratch) as path:
        _load_client_certificate(context, path, env_name)


@contextmanager
def client_certificate_file(env_name: str, scratch: str | None) -> Iterator[Path]:
    """The certificate and key in `env_name` as a private file for git's curl, checked to
    load first (TargetError as `present_client_certificate`); removed when the block ends."""
    with private_pem_file(read_credentials(env_name), "client.pem", scratch) as path:
        _load_client_certificate(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), path, env_name)
        yield path


def _load(env_name: str) -> tuple[str, ssl.SSLContext]:
    """The bundle's text, read now, and a context that trusts it alone; TargetError when the
    variable is unset or its text does not load as PEM certificates."""
    pem = read_credentials(env_name)
    try:
        return pem, ssl.create_default_context(cadata=pem)
    except (ssl.SSLError, ValueError):
        raise TargetError(f"the CA bundle in {env_name} is not PEM certificate text") from None


@functools.cache
def default_trust(*, trust_env: bool = True) -> ssl.SSLContext:
    """What httpx's `verify=True` builds (its create_ssl_context: SSL_CERT_FILE or
    SSL_CERT_DIR where the environment is trusted, else certifi's bundle), once a process
    for each `trust_env`: the environment read is the process's, as at its first use.
    Never to be changed by its users (it is shared)."""
    return httpx.create_ssl_context(trust_env=trust_env)


def ca_bundle(env_name: str) -> str:
    """The bundle's text (checked: it loads as PEM certificates), for git's CA file."""
    return _load(env_name)[0]


def trusted_context(env_name: str) -> ssl.SSLContext:
    """An SSLContext that verifies the server against the bundle in `env_name` only
    (hostname checked, certificate required: `create_default_context`'s defaults)."""
    return _load(env_name)[1]


def trust_source(env_name: str | None) -> str:
    return f"the CA bundle in {env_name}" if env_name else "the default trust store"


def refused_certificate(reason: str, env_name: str | None) -> str:
    """The one message for a server certificate that did not verify (scrubbed: no PEM)."""
    return (
        f"the server's TLS certificate did not verify against {trust_source(env_name)}: "
        f"{reason.strip()} — nothing was sent"
    )


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it was raised from, innermost last (httpx wraps httpcore wraps ssl)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or current.__context__


def certificate_error(exc: BaseException) -> str | None:
    """What the handshake said, when `exc` (an httpx error, through its causes) comes from
    a server certificate that did not verify; else None."""
    for current in _causes(exc):
        if isinstance(current, ssl.SSLCertVerificationError):
            return str(current.verify_message or current.reason or "certificate verify failed")
    return None


def client_certificate_alert(exc: BaseException) -> str | None:
    """The alert, when `exc` (an httpx error, through its causes) is the server refusing our
    client certificate or its absence ("tlsv13 alert certificate required"); else None."""
    for current in _causes(exc):
        reason = getattr(current, "reason", None)
        if (
            isinstance(current, ssl.SSLError)
            and not isinstance(current, ssl.SSLCertVerificationError)
            and isinstance(reason, str)
            and "ALERT" in reason
            and any(alert in reason for alert in _CLIENT_CERTIFICATE_ALERTS)
        ):
            return reason.lower().replace("_", " ")
    return None


def _presented(env_name: str | None) -> str:
    if env_name:
        return f"the client certificate in {env_name}"
    return "a connection without a client certificate (the kind names no client_cert_env)"


def refused_client_certificate(alert: str, env_name: str | None) -> str:
    """The one message for a server that refused our client certificate (scrubbed: names
    the variable, never its text); the caller says whether anything may have been sent."""
    return f"the server refused {_presented(env_name)} (TLS: {alert.strip()})"


def curl_certificate_complaint(stderr: str) -> str | None:
    """git's line saying the https remote's certificate did not verify, else None."""
    for line in stderr.splitlines():
        if any(sign in line for sign in _CURL_CERTIFICATE):
            return _CURL_CA_FILES.sub("", line.strip().removeprefix("fatal: "))
    return None


def curl_session_ended(stderr: str) -> str | None:
    """What git's curl said when the server ended the TLS session at git's first request —
    the refs, a GET, before anything is pushed: how a server refuses a client certificate
    (or its absence); else None."""
    for line in stderr.splitlines():
        found = _CURL_DISCOVERY.match(line.strip())
        if found and any(sign in found["reason"] for sign in _CURL_SESSION_ENDED):
            return found["reason"].strip()
    return None


def refused_at_the_refs(reason: str, env_name: str | None) -> str:
    """The one message for `curl_session_ended`: curl does not say why the server ended
    the session, so it says what is known — when, and what we presented."""
    return (
        f"the server ended the TLS session at git's first request, the refs ({reason.strip()})"
        f" — as a server requiring a client certificate refuses {_presented(env_name)};"
        " nothing was sent"
    )


@contextmanager
def git_tls_config(
    url: str, pem: str | None, scratch: str | None, *, client_cert_env: str | None = None
) -> Iterator[dict[str, str]]:
    """The child environment for one fetch or push of the https remote `url`: git config
    entries given as `GIT_CONFIG_COUNT` / `GIT_CONFIG_KEY_n` / `GIT_CONFIG_VALUE_n` (the same
    scope as `git -c`, without `-c`'s `key=value` parsing, which a URL holding "=" breaks).
    With a bundle (its text, from `ca_bundle`) it is written to a private file
    (`private_pem_file`) removed when the block ends; its directory is also curl's CA path,
    so the system's store (Debian's curl reads /etc/ssl/certs by default) is not trusted
    beside it. With `client_cert_env`, the client certificate and key are a private file of
    their own (`client_certificate_file`, in another directory: never in the CA path),
    given as both `sslCert` and `sslKey`; TargetError when they do not load.

    The keys name the remote's own URL (`http.<url>.sslVerify`): git takes the most specific
    URL match, so a general `http.sslVerify=true` would lose to an `http.<url>.sslVerify
    false` in the worker's gitconfig; the exact URL is the most specific there is, and the
    command scope comes last among equals."""
    entries = {f"http.{url}.sslVerify": "true"}
    with ExitStack() as stack:
        if pem is not None:
            bundle = stack.enter_context(private_pem_file(pem, "ca.pem", scratch))
            entries[f"http.{url}.sslCAInfo"] = str(bundle)
            entries[f"http.{url}.sslCAPath"] = str(bundle.parent)
        if client_cert_env is not None:
            identity = stack.enter_context(client_certificate_file(client_cert_env, scratch))
            entries[f"http.{url}.sslCert"] = str(identity)
            entries[f"http.{url}.sslKey"] = str(identity)
        yield _config_environment(entries)


def _config_environment(entries: dict[str, str]) -> dict[str, str]:
    env = {"GIT_CONFIG_COUNT": str(len(entries))}
    for index, (key, value) in enumerate(entries.items()):
        env |= {f"GIT_CONFIG_KEY_{index}": key, f"GIT_CONFIG_VALUE_{index}": value}
    return env
