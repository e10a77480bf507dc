"""The PostgreSQL advisory-lock namespaces Airlock takes, in one place so that no two
collide: each lock is `pg_advisory_xact_lock(namespace, key)` (the two-int form)."""

from __future__ import annotations

# Per resource kind (approvals/services/write_sets.py): key = crc32 of the kind.
KIND_LOCKS = 7171
# Every write against every kill-switch engage/release (engine/core/killswitch.py): key 1.
KILL_SWITCH = 7172
# Per proposed resource (approvals/services/queued_writes.py): key = crc32 of kind/name.
PROPOSALS = 7173
# The audit head's queue (audit/services.py): key 1; the bench's shared-row floor, key 2.
AUDIT_HEAD_QUEUE = 7174
