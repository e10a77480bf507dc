#!/usr/bin/env bash
# `make bench`: the real stack on loopback (PostgreSQL, a private Redis, the Procfile's
# processes with default settings, a bare gunicorn baseline), HTTP load from wrk; writes
# bench/results/latest.json and prints the table. Never fails on speed.
#   BENCH_DATABASE_URL  database to drop and re-create (default .../airlock_bench)
#   BENCH_REDIS_PORT    port of the private redis-server (default: a free port)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v wrk >/dev/null 2>&1; then
    echo "bench | installing wrk (Debian package)" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get install -y wrk >/dev/null || { $SUDO apt-get update -q && $SUDO apt-get install -y wrk; }
fi
bash scripts/services.sh
exec .venv/bin/python -m bench.run "$@"
