"""The RQ ceiling: a job that does nothing, run by the product's own worker processes."""

from __future__ import annotations


def noop() -> None:
    return None
