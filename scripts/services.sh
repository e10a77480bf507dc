#!/usr/bin/env bash
# Make sure the local PostgreSQL and Redis answer on 127.0.0.1, starting them if not, with the
# commands this machine kind documents. Never restarts or flushes a running server.
set -euo pipefail

if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  echo "PostgreSQL is down: starting it"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
  pg_isready -h 127.0.0.1 -p 5432 -q || { echo "PostgreSQL did not start" >&2; exit 1; }
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "Redis is down: starting it"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || { echo "Redis did not start" >&2; exit 1; }
fi
