"""Fencing tokens: monotonic, issued by PostgreSQL (never by Redis)."""

from __future__ import annotations


def next_fence() -> int:
    """Return a fencing token strictly greater than every token issued before.

    PostgreSQL: nextval('airlock_fence_seq'). SQLite: UPDATE the FenceCounter row.
    Redis losing its data cannot make this go backwards.
    """
    raise NotImplementedError  # owner: core helper
