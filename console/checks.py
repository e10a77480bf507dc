"""Deployment checks of Airlock's own (run by `manage.py check --deploy`)."""

from __future__ import annotations

import logging
import re
from typing import Any

import psycopg
from django.conf import settings
from django.core.checks import CheckMessage, Tags, Warning, register

logger = logging.getLogger("airlock.checks")


@register(Tags.security, deploy=True)
def secret_key_from_environment(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    if settings.SECRET_KEY_FROM_ENV:
        return []
    return [
        Warning(
            "SECRET_KEY is not set in the environment; a key generated into the data folder "
            "is used, which other machines of the deployment do not share.",
            hint="Set SECRET_KEY to the same long random value on every web process.",
            id="airlock.W001",
        )
    ]


@register(Tags.security, deploy=True)
def metrics_token_set(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    """/metrics is open without METRICS_TOKEN: anyone who reaches the site reads
    the deployment's activity (actions, conflicts, latencies, request routes)."""
    if settings.METRICS_TOKEN:
        return []
    return [
        Warning(
            "METRICS_TOKEN is not set: /metrics answers anyone who can reach the site.",
            hint="Set METRICS_TOKEN to a long random value and configure the scraper to send "
            "Authorization: Bearer <METRICS_TOKEN>.",
            id="airlock.W010",
        )
    ]


# Connecting to read max_connections must not hold up a command when the database is away.
MAX_CONNECTIONS_PROBE_TIMEOUT_SECONDS = 3


@register("airlock")
def web_connections_fit_the_database(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    """The web processes' pools (WEB_CONCURRENCY x AIRLOCK_DB_POOL_MAX) must fit in the
    server's max_connections, or requests past it fail to connect (503) under load.
    Silent when the database is not PostgreSQL or cannot be reached (nothing to judge)."""
    database = settings.DATABASES["default"]
    if database.get("ENGINE") != settings.POSTGRES_ENGINE:
        return []
    processes = int(settings.WEB_CONCURRENCY)
    if not settings.AIRLOCK_DB_POOL_WEB:
        return [
            Warning(
                "AIRLOCK_DB_POOL=false: every request thread of a web process keeps a "
                "PostgreSQL connection of its own, so the web processes' connections grow "
                "with the load until max_connections is exhausted.",
                hint="Unset AIRLOCK_DB_POOL (the web processes then pool their connections).",
                id="airlock.W011",
            )
        ]
    if settings.AIRLOCK_PGBOUNCER:
        # The bouncer's max_client_conn takes the web pools, its default_pool_size bounds
        # the server's sessions: neither is readable from here (docs/operations-database.md).
        return []
    max_connections = _server_max_connections(database)
    if max_connections is None:
        return []
    # The pool's connections plus the short poll's own (approvals/api/fastpoll.py).
    pool_max = int(settings.AIRLOCK_DB_POOL_MAX) + int(settings.AIRLOCK_FAST_POLL_CONNECTIONS)
    if processes * pool_max <= max_connections:
        return []
    return [
        Warning(
            f"{processes} web processes (WEB_CONCURRENCY) x {pool_max} connections "
            "(AIRLOCK_DB_POOL_MAX + AIRLOCK_FAST_POLL_CONNECTIONS) = "
            f"{processes * pool_max} exceeds the server's "
            f"max_connections ({max_connections}): under load, requests fail to connect.",
            hint="Lower AIRLOCK_DB_POOL_MAX, AIRLOCK_FAST_POLL_CONNECTIONS or WEB_CONCURRENCY, "
            "or raise max_connections; "
            "leave room for the workers, cron and maintenance sessions too.",
            id="airlock.W011",
        )
    ]


# PgBouncer's default port, and a host named after it: a DATABASE_URL that most likely
# reaches PostgreSQL through a bouncer.
PGBOUNCER_PORT = 6432
_BOUNCER_HOST = re.compile(r"bouncer", re.IGNORECASE)


@register("airlock", deploy=True)
def pgbouncer_declared(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    """A DATABASE_URL that looks like PgBouncer's while AIRLOCK_PGBOUNCER is unset: in
    transaction mode the connections' prepared statements fail as soon as a transaction
    lands on another server session (`prepared statement "_pg3_0" does not exist`)."""
    database = settings.DATABASES["default"]
    if database.get("ENGINE") != settings.POSTGRES_ENGINE or settings.AIRLOCK_PGBOUNCER:
        return []
    host, port = str(database.get("HOST") or ""), str(database.get("PORT") or "")
    if port != str(PGBOUNCER_PORT) and not _BOUNCER_HOST.search(host):
        return []
    return [
        Warning(
            f"DATABASE_URL ({host or 'localhost'}:{port or 5432}) looks like PgBouncer, but "
            "AIRLOCK_PGBOUNCER is not set: behind transaction pooling, prepared statements "
            "fail once a transaction runs on another server session.",
            hint="Set AIRLOCK_PGBOUNCER=transaction (prepared statements off) or "
            "AIRLOCK_PGBOUNCER=session to say which pooling the bouncer does; see "
            "docs/operations-database.md.",
            id="airlock.W020",
        )
    ]


@register("airlock", deploy=True)
def pgbouncer_prepared_statements(app_configs: Any, **kwargs: Any) -> list[CheckMessage]:
    """Transaction pooling with prepared statements turned back on works only where the
    bouncer tracks them (PgBouncer >= 1.22, max_prepared_statements > 0): say so."""
    if settings.AIRLOCK_PGBOUNCER != "transaction" or settings.AIRLOCK_DB_PREPARE_THRESHOLD is None:
        return []
    return [
        Warning(
            "AIRLOCK_PGBOUNCER=transaction with AIRLOCK_DB_PREPARE_THRESHOLD="
            f"{settings.AIRLOCK_DB_PREPARE_THRESHOLD}: prepared statements behind transaction "
            "pooling need PgBouncer >= 1.22 with max_prepared_statements > 0; otherwise "
            'statements fail with `prepared statement "_pg3_..." does not exist`.',
            hint="Unset AIRLOCK_DB_PREPARE_THRESHOLD (or set it to off), or confirm the "
            "bouncer's version and max_prepared_statements (docs/operations-database.md).",
            id="airlock.W021",
        )
    ]


def _server_max_connections(database: dict[str, Any]) -> int | None:
    # Keys Django's backend consumes itself; the rest are psycopg connection options.
    django_only = {"pool", "server_side_binding"}
    options = {k: v for k, v in database.get("OPTIONS", {}).items() if k not in django_only}
    params = {
        "dbname": database.get("NAME") or "postgres",
        "user": database.get("USER") or None,
        "password": database.get("PASSWORD") or None,
        "host": database.get("HOST") or None,
        "port": database.get("PORT") or None,
        **options,
        "connect_timeout": MAX_CONNECTIONS_PROBE_TIMEOUT_SECONDS,
    }
    try:
        with psycopg.connect(**{k: v for k, v in params.items() if v is not None}) as conn:
            row = conn.execute("SHOW max_connections").fetchone()
    except psycopg.Error as exc:
        logger.info("max_connections not checked: the database did not answer (%s)", exc)
        return None
    return int(row[0]) if row else None
