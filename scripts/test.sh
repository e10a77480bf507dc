#!/usr/bin/env bash
# Run the whole suite against real PostgreSQL and Redis, starting them if they are down.
set -euo pipefail
cd "$(dirname "$0")/.."

export DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/airlock}"
export REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/0}"

if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  echo "PostgreSQL is down: starting it"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "Redis is down: starting it"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
fi

exec .venv/bin/pytest "$@"
