"""Versions as tokens (issue 39): a resource's version is the token its store gives it, text
compared exactly. Airlock's own store counts with an integer and writes it as its decimal
text ("41"); these two functions are the only place that crosses between the two."""

from __future__ import annotations


def counter(token: str | None) -> int | None:
    """The managed store's counter from its token (None stays None)."""
    return None if token is None else int(token)


def token(version: int | None) -> str | None:
    """The token of a managed-store counter (None stays None)."""
    return None if version is None else str(version)
