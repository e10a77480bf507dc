"""A prepared statement whose plan a migration made stale (pure: no I/O of its own).

psycopg prepares a statement on a connection once it ran there `prepare_threshold` times
(console/settings.py; the poll front prepares its two at once). PostgreSQL re-plans such a
statement when a table it reads changes, but when the change alters the columns it returns
(`ALTER COLUMN ... TYPE`, a migration run while the web and worker processes serve) it
refuses instead: `cached plan must not change result type` (SQLSTATE 0A000), on every
execution, on every connection that prepared it, until that connection closes. The error is
raised before the statement does anything, so dropping the connection's prepared statements
(`DEALLOCATE ALL`, which psycopg also reads as "forget your own cache") and running the
statement again is safe wherever no earlier statement of the same transaction would be
lost: the callers (console/pgbackend, approvals/api/fastpoll_sql.py) retry only there.
"""

from __future__ import annotations

import psycopg

# Sent on the connection (prepare=False): PostgreSQL drops the session's prepared
# statements and psycopg, seeing the command's status, clears its cache of their names.
DEALLOCATE_ALL = "DEALLOCATE ALL"
# plancache.c's function that raises it: the locale-independent mark of this error (the
# message is translated under another lc_messages; 0A000 alone is any unsupported feature).
_SOURCE_FUNCTION = "RevalidateCachedQuery"
_MESSAGE = "cached plan must not change result type"


def is_stale_plan(error: BaseException) -> bool:
    """Is `error` PostgreSQL refusing a prepared statement whose result type changed?"""
    if not isinstance(error, psycopg.errors.FeatureNotSupported):
        return False
    diag = error.diag
    return diag.source_function == _SOURCE_FUNCTION or diag.message_primary == _MESSAGE
