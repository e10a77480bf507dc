#!/usr/bin/env bash
# `make test`: the whole suite against real PostgreSQL and Redis, starting them if they are
# down (with the commands this machine kind documents), Chromium and wrk installed when missing.
# Exits non-zero on any failure, including pytest's "no tests collected" (5).
set -euo pipefail
cd "$(dirname "$0")/.."

export DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/airlock}"
export REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/0}"

bash scripts/services.sh

if [[ -x scripts/install-browser.sh || -f scripts/install-browser.sh ]]; then
  bash scripts/install-browser.sh
else
  echo "scripts/install-browser.sh is missing: browser tests will fail to find Chromium" >&2
fi

# Debian packages the suite drives as real peers, installed when missing (one apt run):
# wrk (the deployment load tests), pgbouncer (tests/test_db_pgbouncer.py serves the web line
# through a transaction-mode PgBouncer), apache2 (mod_dav: a WebDAV server with strong ETags
# nobody here wrote, for the HTTP target adapter; also git's smart HTTP for the git adapter),
# openssh-server + openssh-client (sshd serving the git adapter's ssh remotes; ssh-keygen
# makes the test's host and client keys: tests/fixtures/sshd.py).
missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v pgbouncer >/dev/null 2>&1 || [[ -x /usr/sbin/pgbouncer ]] || missing+=(pgbouncer)
command -v apache2 >/dev/null 2>&1 || [[ -x /usr/sbin/apache2 ]] || missing+=(apache2)
[[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)
{ command -v ssh && command -v ssh-keygen; } >/dev/null 2>&1 || missing+=(openssh-client)
if (( ${#missing[@]} )); then
  if [[ "$(id -u)" -ne 0 ]]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  # No service starts at install (the tests start their own on free ports).
  DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 $SUDO apt-get install -y -qq "${missing[@]}"
fi

set +e
# The slowest tests named at the end: what to look at first when the suite grows slow.
.venv/bin/pytest --durations=40 "$@"
status=$?
set -e
if [[ $status -eq 5 ]]; then
  echo "make test: pytest collected no tests — treating that as a failure" >&2
fi
exit $status
