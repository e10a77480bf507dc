"""A job for tests to enqueue: it imports nothing of the product, so what it reports was
loaded by the worker before it ran."""

from __future__ import annotations

import sys


def modules_loaded(names: list[str]) -> dict[str, bool]:
    return {name: name in sys.modules for name in names}
