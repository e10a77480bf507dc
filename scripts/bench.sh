#!/usr/bin/env bash
# `make bench`: the real stack on loopback (PostgreSQL, a private Redis, uvicorn, RQ workers),
# a separate load generator; writes bench/results/latest.json and prints a table.
# Never fails on speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
exec .venv/bin/python -m bench.run "$@"
