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
"""

from __future__ import annotations

import os
import re
import ssl
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.targets.base import TargetError, read_credentials

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


def _load(env_name: str) -> tuple[str, ssl.SSLContext]:
    """The bundle's text, read now, and a context that trusts it alone; TargetError when the
    variable is unset or its text does not load as PEM certificates."""
    pem = read_credentials(env_name)
    try:
        return pem, ssl.create_default_context(cadata=pem)
    except (ssl.SSLError, ValueError):
        raise TargetError(f"the CA bundle in {env_name} is not PEM certificate text") from None


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


def certificate_error(exc: BaseException) -> str | None:
    """What the handshake said, when `exc` (an httpx error, through its causes) comes from
    a server certificate that did not verify; else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLCertVerificationError):
            return str(current.verify_message or current.reason or "certificate verify failed")
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def curl_certificate_complaint(stderr: str) -> str | None:
    """git's line saying the https remote's certificate did not verify, else None."""
    for line in stderr.splitlines():
        if any(sign in line for sign in _CURL_CERTIFICATE):
            return _CURL_CA_FILES.sub("", line.strip().removeprefix("fatal: "))
    return None


@contextmanager
def git_tls_config(url: str, pem: str | None, scratch: str | None) -> Iterator[dict[str, str]]:
    """The child environment for one fetch or push of the https remote `url`: git config
    entries given as `GIT_CONFIG_COUNT` / `GIT_CONFIG_KEY_n` / `GIT_CONFIG_VALUE_n` (the same
    scope as `git -c`, without `-c`'s `key=value` parsing, which a URL holding "=" breaks).
    With a bundle (its text, from `ca_bundle`) it is written to a fresh 0700 directory (the
    file 0600; in `scratch`, memory when that is /dev/shm) and removed when the block ends;
    the directory is also curl's CA path, so the system's store (Debian's curl reads
    /etc/ssl/certs by default) is not trusted beside it.

    The keys name the remote's own URL (`http.<url>.sslVerify`): git takes the most specific
    URL match, so a general `http.sslVerify=true` would lose to an `http.<url>.sslVerify
    false` in the worker's gitconfig; the exact URL is the most specific there is, and the
    command scope comes last among equals."""
    if pem is None:
        yield _config_environment({f"http.{url}.sslVerify": "true"})
        return
    with tempfile.TemporaryDirectory(prefix="airlock-tls-", dir=scratch) as folder:
        bundle = Path(folder) / "ca.pem"
        fd = os.open(bundle, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(pem)
        yield _config_environment(
            {
                f"http.{url}.sslVerify": "true",
                f"http.{url}.sslCAInfo": str(bundle),
                f"http.{url}.sslCAPath": folder,
            }
        )


def _config_environment(entries: dict[str, str]) -> dict[str, str]:
    env = {"GIT_CONFIG_COUNT": str(len(entries))}
    for index, (key, value) in enumerate(entries.items()):
        env |= {f"GIT_CONFIG_KEY_{index}": key, f"GIT_CONFIG_VALUE_{index}": value}
    return env
